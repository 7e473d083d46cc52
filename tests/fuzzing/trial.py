"""A ``smoke`` trial under attack: launched with the real launcher and the local scheduler, its
workers' addresses and drop counters (read through ``ping``, as the master reads them), and
whether it still completes.

The rollout workers send their few trajectories first; the master then keeps the trial running
for ``smoke.min_duration`` seconds, pinging every worker, and completes. Attacks run in that
window (:attr:`LiveTrial.attack_until`).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from typing import Any

from system import names
from system.bootstrap import read_secret
from system.errors import RpcError
from system.rpc import RpcClient
from system.wire import Codec
from tests.helpers import REPO, launch_argv, read_summary, trial_name_resolve

EXP = "smoke"
COUNTS = {"master": 1, "model": 2, "generation": 2, "rollout": 4}
"""The smoke experiment's workers (its defaults)."""
TRAJECTORIES = 2
"""Per rollout worker: they finish at once, so only the attacks run in the window."""
LIMIT = 1 << 20
"""``rpc.max_message_bytes`` of the trial: small, so oversized messages are cheap to send."""
MARGIN = 4.0
"""Seconds before the master may complete after which no attack starts."""


@dataclasses.dataclass
class LiveTrial:
    proc: subprocess.Popen
    fileroot: str
    trial: str
    codec: Codec
    addresses: dict[str, str]
    """``kind/index`` of every worker, and ``stream`` (the master's trajectory stream)."""
    attack_until: float
    """``time.monotonic()`` after which the master may complete: stop attacking before."""
    observed: dict[str, int] = dataclasses.field(default_factory=dict)
    """Drops each target counted while under attack (the fuzz's own tally of them)."""
    _clients: dict[str, RpcClient] = dataclasses.field(default_factory=dict)

    @property
    def workers(self) -> list[str]:
        return [n for n in self.addresses if n != "stream"]

    def ping(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        """A legitimate ping (raises :class:`~system.errors.RpcError` if it is not answered)."""
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = RpcClient(self.codec, self.addresses[name], timeout)
        try:
            return client.call("ping", timeout=timeout)
        except RpcError:
            client.close()
            del self._clients[name]
            raise

    def drops(self, name: str) -> dict[str, int]:
        """What ``name`` has counted so far, by reason; the stream: ``{"total": n}`` (the
        master shows only the total)."""
        if name == "stream":
            return {"total": int(self.ping("master/0")["progress"].get("dropped") or 0)}
        return dict(self.ping(name)["drops"])

    def alive(self, name: str) -> bool:
        """The worker (the master, for the stream) still answers a legitimate ping."""
        try:
            self.ping("master/0" if name == "stream" else name)
            return True
        except RpcError:
            return False

    def pid(self, name: str) -> int:
        return int(self.ping(name)["pid"])

    def finish(self, timeout: float) -> tuple[int, dict[str, Any]]:
        """Wait for the launcher to exit; its exit code and the trial's summary."""
        self.close()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(self.proc)
            code = self.proc.returncode
        try:
            return code, read_summary(self.fileroot, EXP, self.trial)
        except OSError:
            return code, {}

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()


def launch(fileroot: str, trial: str, attack_seconds: float) -> LiveTrial:
    """Launch ``smoke`` so that the master completes ``attack_seconds`` (plus margins) after
    its rollouts are done; returns once they are."""
    duration = attack_seconds + MARGIN + 5  # the master starts its clock before the rollouts
    # heartbeats: 15 s, not 5: what is tested is that attacks are dropped and counted; a CI run
    # beside three RL trials saw a worker's heartbeat thread starved for 10 s mid-attack
    log = open(os.path.join(os.path.dirname(os.path.abspath(fileroot)), f"{trial}.out"), "w")
    proc = subprocess.Popen(launch_argv(
        f"exp={EXP}", f"trial={trial}", f"cluster.fileroot={fileroot}",
        "scheduler.stop_grace=3", f"smoke.trajectories_per_worker={TRAJECTORIES}",
        f"smoke.min_duration={duration:.1f}", f"rpc.max_message_bytes={LIMIT}",
        "controller.progress=false", "controller.heartbeat_ttl=15"),  # (see below)
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        return _connect(proc, fileroot, trial, duration)
    except BaseException:
        stop(proc)
        raise


def _connect(proc: subprocess.Popen, fileroot: str, trial: str, duration: float) -> LiveTrial:
    nr = trial_name_resolve(fileroot, EXP, trial)
    addresses = {f"{k}/{i}": nr.wait(names.worker_address(EXP, trial, k, i), timeout=120)
                 for k, n in COUNTS.items() for i in range(n)}
    addresses["stream"] = nr.wait(names.stream(EXP, trial, "trajectories"), timeout=120)
    secret = read_secret(os.path.join(fileroot, EXP, trial, "secret"))
    t = LiveTrial(proc, fileroot, trial, Codec(secret, LIMIT), addresses, 0.0)
    done = f"{TRAJECTORIES * COUNTS['rollout']}/{TRAJECTORIES * COUNTS['rollout']}"
    deadline = time.monotonic() + 120
    while t.ping("master/0")["progress"].get("trajectories") != done:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the smoke trial's rollouts did not finish (exit {proc.poll()})")
        time.sleep(0.1)
    # the master's role (and its min_duration) started after its process did
    t.attack_until = time.monotonic() - t.ping("master/0")["uptime"] + duration - MARGIN
    return t


def stop(proc: subprocess.Popen) -> None:
    """Stop a launcher that is still running (Ctrl-C, then kill)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
