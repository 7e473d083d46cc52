"""``smoke``: the control plane end to end, no model.

Rollout workers ask generation servers to echo token tensors and stream tensor-carrying
trajectories to the master; model workers all-reduce a tensor over a gloo group rendezvoused
through name resolution; the master pings every worker, collects their reports and completes.
``smoke.crash=KIND:INDEX:SECONDS[:kill|stop]`` makes one worker die hard (``kill``: SIGKILL) or
hang (``stop``: SIGSTOP, so only its heartbeat tells) that many seconds after it starts.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from typing import Any

import numpy as np

from experiments.registry import Experiment, Roles
from scheduler.gpu_plan import GpuDemand
from system import names
from system.launcher.config import ExperimentConfig
from system.errors import ConfigError, RpcError
from system.streams import StreamPuller
from workers.base import Worker
from workers.client import WorkerClient, collect_settled
from workers.generation import GenerationClient, GenerationServer
from workers.kinds import KINDS as WORKER_KINDS
from workers.master import MasterWorker
from workers.model import ModelWorker
from workers.peers import PeerClients
from workers.rollout import RolloutWorker
from workers.schema import WorkerReport

KINDS = tuple(WORKER_KINDS)


@dataclasses.dataclass
class SmokeConfig:
    """The smoke experiment's own settings."""

    trajectories_per_worker: int = 100
    """Trajectories each rollout worker streams to the master."""
    tokens_per_trajectory: int = 256
    """Length of each trajectory's token tensor."""
    allreduce_numel: int = 4096
    """Elements of the tensor the model workers all-reduce."""
    ping_interval: float = 0.1
    """Seconds between the master's ping rounds."""
    min_duration: float = 0.0
    """The master runs at least this many seconds (pinging) before completing."""
    timeout: float = 120.0
    """The master fails if the trajectories have not all arrived within this many seconds."""
    crash: str = ""
    """Fault injection ``KIND:INDEX:SECONDS[:kill|stop]`` (empty: none)."""
    generation_gpus: int = 1
    """GPUs each generation server claims where GPUs are placed (what an RL experiment's
    tensor-parallel size claims); the echo servers use none of them."""

    def __post_init__(self) -> None:
        for key in ("trajectories_per_worker", "tokens_per_trajectory", "allreduce_numel",
                    "generation_gpus"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be > 0, got {self.timeout}")
        for key in ("ping_interval", "min_duration"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0 (seconds), got {getattr(self, key)}")
        self.crash_spec()  # validate

    def crash_spec(self) -> tuple[str, int, float, str] | None:
        if not self.crash:
            return None
        parts = self.crash.split(":")
        try:
            kind, index, seconds = parts[0], int(parts[1]), float(parts[2])
            mode = parts[3] if len(parts) > 3 else "kill"
            if len(parts) > 4:
                raise ValueError
        except (IndexError, ValueError):
            raise ConfigError(f"crash={self.crash!r} is not KIND:INDEX:SECONDS[:kill|stop]"
                              ) from None
        if kind not in KINDS:
            raise ConfigError(f"crash kind {kind!r} is not one of {list(KINDS)}")
        if mode not in ("kill", "stop") or index < 0 or seconds < 0:
            raise ConfigError(f"crash={self.crash!r}: mode must be kill|stop, "
                              "index and seconds >= 0")
        return kind, index, seconds, mode


@dataclasses.dataclass
class SmokeExperimentConfig(ExperimentConfig):
    """Root config of the smoke experiment."""

    smoke: SmokeConfig = dataclasses.field(default_factory=SmokeConfig)
    """The smoke experiment's own settings."""

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = self.smoke.crash_spec()
        if spec and spec[1] >= self.worker_counts()[spec[0]]:
            raise ConfigError(f"smoke.crash={self.smoke.crash!r}: there are only "
                              f"{self.worker_counts()[spec[0]]} {spec[0]} worker(s)")

    def gpu_demands(self) -> list[GpuDemand]:
        return [GpuDemand("model", self.model.count, 1, "model.count"),
                GpuDemand("generation", self.generation.count, self.smoke.generation_gpus,
                          "generation.count x smoke.generation_gpus")]


def smoke() -> SmokeExperimentConfig:
    """Control-plane smoke test: real processes, sockets, streams and a gloo all-reduce; no model."""
    return SmokeExperimentConfig()


# --- roles -------------------------------------------------------------------------------------

def _cfg(worker: Worker) -> SmokeConfig:
    cfg = SmokeConfig(**worker.config["experiment"])
    spec = cfg.crash_spec()
    if spec and spec[0] == worker.kind and spec[1] == worker.index:
        _, _, seconds, mode = spec
        sig = signal.SIGKILL if mode == "kill" else signal.SIGSTOP
        timer = threading.Timer(seconds, os.kill, args=(os.getpid(), sig))
        timer.daemon = True
        timer.start()
    return cfg


PLACEMENT_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME")


def _placement() -> dict[str, Any]:
    """Where this worker runs and what it was told of its devices and ranks (absent: None)."""
    return {"host": socket.gethostname(), **{k: os.environ.get(k) for k in PLACEMENT_ENV}}


def _checksum(tokens: np.ndarray) -> int:
    return int(tokens.astype(np.int64).sum())


def _trajectory_problem(msg: Any) -> str | None:
    """What is wrong with a smoke trajectory (the master drops and counts it), or None."""
    if not isinstance(msg, dict):
        return "not a map"
    for key, kind in (("worker", int), ("seq", int), ("checksum", int),
                      ("tokens", np.ndarray), ("logprobs", np.ndarray)):
        if not isinstance(msg.get(key), kind):
            return f"{key} is not {kind.__name__}"
    return None


def rollout_role(worker: RolloutWorker) -> dict[str, Any]:
    cfg = _cfg(worker)
    pusher = worker.trajectory_stream()
    gens = sorted(worker.peers("generation").items())
    clients = [GenerationClient(worker.client(addr), name) for name, addr in gens]
    rng = np.random.default_rng(worker.index)
    sent = echoed = 0
    try:
        for seq in range(cfg.trajectories_per_worker):
            if worker.stopping:
                break
            tokens = rng.integers(0, 32000, cfg.tokens_per_trajectory, dtype=np.int32)
            if clients:
                reply = clients[seq % len(clients)].echo(tokens).result()
                if not np.array_equal(reply["tokens"], tokens):
                    raise RuntimeError("generation server echoed different tokens")
                echoed += 1
            pusher.send({"worker": worker.index, "seq": seq, "tokens": tokens,
                         "logprobs": -rng.random(cfg.tokens_per_trajectory, dtype=np.float32),
                         "reward": float(rng.random()), "version": 0,
                         "checksum": _checksum(tokens)},
                        timeout=worker.rollout_cfg.push_timeout)
            sent += 1
    finally:
        for c in clients:
            c.close()
        pusher.close()
    return {"sent": sent, "echoed": echoed, "placement": _placement()}


def generation_role(worker: GenerationServer) -> dict[str, Any]:
    _cfg(worker)
    worker.result = {"placement": _placement()}  # reported while it serves (the master asks then)
    worker.wait_stop()  # serves echo requests from its RPC thread until stopped
    return {"requests": worker.requests, "placement": _placement()}


def model_role(worker: ModelWorker) -> dict[str, Any]:
    import torch

    cfg = _cfg(worker)
    pg = worker.new_group("smoke_allreduce")
    t = torch.full((cfg.allreduce_numel,), float(worker.index + 1))
    pg.allreduce([t]).wait()
    n = worker.world_size
    expected = n * (n + 1) / 2
    return {"allreduce_ok": bool(torch.all(t == expected)), "allreduce_value": float(t[0]),
            "expected": expected, "world_size": n, "tensor": t[:8],
            "local_rank": worker.local_rank, "device": worker.device,
            "gpus_on_node": int(os.environ.get("SLURM_GPUS_ON_NODE", 0)),
            "placement": _placement()}


def master_role(master: MasterWorker) -> dict[str, Any]:
    cfg = _cfg(master)
    counts: dict[str, int] = master.config["counts"]
    expected = counts["rollout"] * cfg.trajectories_per_worker
    puller = StreamPuller(master.codec, master.host, master.rpc_cfg.stream_hwm,
                          validate=_trajectory_problem)
    master.name_resolve.add(names.stream(master.exp, master.trial, "trajectories"),
                            puller.address, replace=True)
    ping_timeout = min(master.master_cfg.peer_timeout, 2.0)
    peers = PeerClients(master.peers, lambda a: master.client(a, master.master_cfg.peer_timeout),
                        exclude=master.name)
    t0 = time.monotonic()
    inbox = _Inbox(puller, cfg)
    pings = ping_failures = 0
    next_ping = 0.0
    try:
        while len(inbox.seen) < expected or time.monotonic() - t0 < cfg.min_duration:
            if master.stopping:
                raise RuntimeError("stopped before completion")
            if time.monotonic() - t0 > max(cfg.timeout, cfg.min_duration + 10):
                raise TimeoutError(f"only {len(inbox.seen)}/{expected} trajectories within "
                                   f"{cfg.timeout:.0f}s")
            inbox.take(0.05)
            if time.monotonic() >= next_ping:
                peers.refresh()
                results = collect_settled([c.ping() for c in peers.all()], ping_timeout)
                pings += len(results)
                ping_failures += sum(isinstance(r, Exception) for r in results)
                next_ping = time.monotonic() + cfg.ping_interval
            master.set_progress(trajectories=f"{len(inbox.seen)}/{expected}",
                                dropped=puller.drops.total or None)
        _wait_peers_done(master, peers, cfg, ping_timeout, inbox)
        clients = peers.all()
        reports = collect_settled([c.report() for c in clients], master.master_cfg.peer_timeout)
    finally:
        peers.close()
        puller.close()
    out = _results(inbox, expected, clients, reports, puller.drops.as_dict(),
                   {"pings": pings, "ping_failures": ping_failures,
                    "seconds": round(time.monotonic() - t0, 3)})
    out["placement"][master.name] = _placement()
    return out


def _results(inbox: "_Inbox", expected: int, clients: list[WorkerClient],
             reports: list[WorkerReport | RpcError], stream_drops: dict[str, int],
             extra: dict[str, Any]) -> dict[str, Any]:
    """The smoke run's figures, from the stream and every worker's report."""
    failed = {c.name: str(r) for c, r in zip(clients, reports) if isinstance(r, Exception)}
    if failed:
        raise RuntimeError(f"reports failed: {failed}")
    ok = [(c, r) for c, r in zip(clients, reports) if not isinstance(r, Exception)]
    model = [r["result"] for c, r in ok if c.kind == "model"]
    return {
        "trajectories_expected": expected,
        "trajectories_received": len(inbox.seen),
        "trajectories_valid": inbox.valid,
        "trajectories_duplicate": inbox.duplicates,
        "trajectory_bytes": inbox.nbytes,
        "per_rollout_worker": {str(k): v for k, v in sorted(inbox.per_worker.items())},
        "worker_restarts": {c.name: r["restart"] for c, r in ok if r["restart"]},
        "pings": extra["pings"],
        "ping_failures": extra["ping_failures"],
        "reports": len(reports),
        "generation_requests": sum(r.get("requests", 0) for c, r in ok
                                   if c.kind == "generation"),
        "allreduce_ok": all(m["allreduce_ok"] for m in model) if model else None,
        "allreduce_values": [m["allreduce_value"] for m in model],
        "model_gpus_on_node": [m["gpus_on_node"] for m in model],
        "model_local_ranks": [m["local_rank"] for m in model],
        "model_devices": [m["device"] for m in model],
        "placement": {c.name: r["result"]["placement"] for c, r in ok
                      if isinstance(r["result"], dict) and "placement" in r["result"]},
        "dropped_messages": sum(sum(r["drops"].values()) for _, r in ok)
        + sum(stream_drops.values()),
        "stream_drops": stream_drops,
        "seconds": extra["seconds"],
    }


class _Inbox:
    """The master's side of the trajectory stream: validates, and counts each (worker, seq) once
    (a requeued rollout worker sends its trajectories again)."""

    def __init__(self, puller: StreamPuller, cfg: SmokeConfig) -> None:
        self.puller, self.cfg = puller, cfg
        self.seen: set[tuple[int, int]] = set()
        self.valid = self.duplicates = self.nbytes = 0
        self.per_worker: dict[int, int] = {}

    def take(self, timeout: float) -> None:
        msg = self.puller.recv(timeout)
        if msg is None:
            return
        key = (int(msg["worker"]), int(msg["seq"]))
        if key in self.seen:
            self.duplicates += 1
            return
        self.seen.add(key)
        tokens = msg["tokens"]
        self.nbytes += tokens.nbytes + msg["logprobs"].nbytes
        self.valid += int(tokens.shape == (self.cfg.tokens_per_trajectory,)
                          and tokens.dtype == np.int32 and _checksum(tokens) == msg["checksum"])
        self.per_worker[key[0]] = self.per_worker.get(key[0], 0) + 1


def _wait_peers_done(master: MasterWorker, peers: PeerClients, cfg: SmokeConfig, timeout: float,
                     inbox: _Inbox) -> None:
    """Wait until every model and rollout worker finished its role (generation servers serve
    until stopped), reading the stream meanwhile."""
    deadline = time.monotonic() + cfg.timeout
    while True:
        inbox.take(0.0)
        peers.refresh()
        finite = peers.of_kind("model", "rollout")
        pings = collect_settled([c.ping() for c in finite], timeout)
        pending = [c.name for c, p in zip(finite, pings)
                   if isinstance(p, Exception) or p["state"] != "completed"]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not finish: {pending}")
        if master.stopping:
            raise RuntimeError("stopped before completion")
        inbox.take(0.05)


SMOKE = Experiment("smoke", smoke, Roles(master=master_role, model=model_role,
                                         generation=generation_role, rollout=rollout_role),
                   section="smoke")
