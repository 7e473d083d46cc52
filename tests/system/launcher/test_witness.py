"""The witness of a worker process (what run_worker forks under Slurm), with real processes and
a real file name resolution: it vouches for its worker while that process lives, stopped or
not, stops vouching at once when it dies, and ends it on the controller's order for that
incarnation only."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from system import names
from system.bootstrap import Bootstrap
from system.errors import NameEntryNotFound
from system.launcher.witness import StopOrder, order_stop
from system.name_resolve import FileNameResolve
from system.private_files import write_private
from system.wire import new_secret
from tests.helpers import REPO

WORKER = """
import signal, sys, time
from system.bootstrap import Bootstrap
from system.launcher import witness
if sys.argv[2] == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
witness.start(Bootstrap.read(sys.argv[1]), "rollout", int(sys.argv[3]))
time.sleep(120)
"""
"""A stand-in for run_worker's process: it forks its witness, then does nothing (SIGTERM kills
it, unless ``deaf``)."""


class Trial:
    """A trial's bootstrap file, secret and name resolution, and worker processes of it."""

    def __init__(self, root: str, ttl: float) -> None:
        self.dir = os.path.join(root, "trial")
        os.makedirs(self.dir, mode=0o700)
        secret = new_secret()
        write_private(os.path.join(self.dir, "secret"), secret)
        self.boot = os.path.join(self.dir, "bootstrap.json")
        Bootstrap(exp="e", trial="t", experiment="smoke", trial_dir=self.dir, interface="",
                  scheduler="slurm", name_resolve={"type": "file"},
                  name_resolve_root=os.path.join(root, "nr"), rpc={},
                  heartbeat_ttl=ttl).write(self.boot)
        self.nr = FileNameResolve(os.path.join(root, "nr"), secret=secret)
        self.procs: list[subprocess.Popen] = []

    def worker(self, mode: str = "plain", index: int = 1) -> subprocess.Popen:
        """Worker rollout/``index``; its stderr (the witness's lines) in :meth:`said`."""
        err = open(os.path.join(self.dir, f"err-{index}"), "w")
        proc = subprocess.Popen([sys.executable, "-c", WORKER, self.boot, mode, str(index)],
                                cwd=REPO, stderr=err)
        err.close()
        self.procs.append(proc)
        return proc

    def said(self, index: int = 1) -> str:
        with open(os.path.join(self.dir, f"err-{index}")) as f:
            return f.read()

    def alive(self, index: int = 1) -> str | None:
        try:
            return self.nr.get(names.alive("e", "t", "rollout", index))
        except NameEntryNotFound:
            return None

    def order(self, index: int = 1) -> str | None:
        try:
            return self.nr.get(names.stop_order("e", "t", "rollout", index))
        except NameEntryNotFound:
            return None

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.nr.close()


@pytest.fixture
def trial(tmp_path):
    made: list[Trial] = []

    def make(ttl: float) -> Trial:
        made.append(Trial(str(tmp_path), ttl))
        return made[-1]

    yield make
    for t in made:
        t.close()


def until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid:
            out.append(int(entry))
    return out


def running(pid: int) -> bool:
    """Live and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_it_vouches_while_its_worker_lives_stopped_or_not_and_not_a_moment_longer(trial):
    t = trial(ttl=1.0)
    proc = t.worker()
    me = until(t.alive, 30, "the witness's alive key")
    host, pid, nonce = me.split(":")
    assert (host, pid) == (socket.gethostname(), str(proc.pid)) and len(nonce) == 8
    (witness,) = until(lambda: children(proc.pid), 5, "the witness process")
    os.kill(witness, signal.SIGTERM)  # (scancel signals every process of a job's step)
    os.kill(proc.pid, signal.SIGSTOP)  # hung: no thread of the worker runs
    time.sleep(4.0)  # longer than the alive key's own TTL (3 heartbeat TTLs)
    assert t.alive() == me and running(witness)
    os.kill(proc.pid, signal.SIGKILL)
    until(lambda: t.alive() is None, 5, "the alive key's deletion")
    # deleted, not expired (its TTL could have ended it: the file service leaves an expired
    # entry's file behind, and a loaded machine may take seconds to show it gone)
    assert not os.path.exists(t.nr._path(names.alive("e", "t", "rollout", 1)))
    until(lambda: not running(witness), 5, "the witness's exit")


def test_an_order_for_its_incarnation_ends_a_hung_worker_term_then_kill(trial):
    t = trial(ttl=1.5)
    polite, deaf = t.worker(index=1), t.worker("deaf", index=2)
    ones = until(lambda: t.alive(1) and t.alive(2) and (t.alive(1), t.alive(2)), 30,
                 "both alive keys")
    for proc in (polite, deaf):
        os.kill(proc.pid, signal.SIGSTOP)
    t.nr.add(names.stop_order("e", "t", "rollout", 1), StopOrder(ones[0], 30.0).to_json(),
             replace=True)
    assert polite.wait(10) == -signal.SIGTERM  # stopped, yet SIGTERM reached it (SIGCONT)
    assert deaf.poll() is None
    t.nr.add(names.stop_order("e", "t", "rollout", 2), StopOrder(ones[1], 1.0).to_json(),
             replace=True)
    t0 = time.monotonic()
    assert deaf.wait(15) == -signal.SIGKILL  # it ignores SIGTERM: killed after the grace
    assert time.monotonic() - t0 > 0.9
    for i in (1, 2):
        until(lambda i=i: t.order(i) is None and t.alive(i) is None, 5, "order and key deleted")
    assert f"witness of rollout/2: ordered to end {ones[1]}: SIGTERM, SIGKILL in 1s" in t.said(2)


def test_orders_for_another_incarnation_and_malformed_ones_are_left_alone(trial):
    t = trial(ttl=0.5)  # the order is read every 0.5 s
    proc = t.worker()
    me = until(t.alive, 30, "the alive key")
    key = names.stop_order("e", "t", "rollout", 1)
    host, pid, _ = me.split(":")
    # the same host and pid (a container's own pid namespace repeats them), another nonce
    t.nr.add(key, StopOrder(f"{host}:{pid}:00000000", 0.0).to_json(), replace=True)
    time.sleep(1.5)  # three reads of the order
    t.nr.add(key, '{"incarnation": 7}', replace=True)
    until(lambda: "ignored a malformed order" in t.said(), 10, "the malformed order's line")
    time.sleep(1.5)  # read again, not said again
    assert proc.poll() is None and t.alive() == me and t.order() == '{"incarnation": 7}'
    assert t.said().count("ignored a malformed order") == 1, t.said()


def test_order_stop_names_the_vouched_incarnation_or_nothing(trial):
    t = trial(ttl=5.0)
    assert order_stop(t.nr, "e", "t", "rollout/1", 3.0) is None and t.order() is None
    t.nr.add(names.alive("e", "t", "rollout", 1), "node7:4242:0a1b2c3d", replace=True)
    assert order_stop(t.nr, "e", "t", "rollout/1", 3.0) == "node7:4242:0a1b2c3d"
    assert StopOrder.from_json(t.order()) == StopOrder("node7:4242:0a1b2c3d", 3.0)


@pytest.mark.parametrize("text", ['[]', '{"incarnation": "h:1"}', '{"incarnation": "", "grace": 1}',
                                  '{"incarnation": "h:1", "grace": -1}',
                                  '{"incarnation": "h:1", "grace": true}',
                                  '{"incarnation": "h:1", "grace": NaN}',
                                  '{"incarnation": "h:1", "grace": 1, "more": 0}', 'nan'])
def test_malformed_orders_are_refused(text):
    with pytest.raises(ValueError):
        StopOrder.from_json(text)
