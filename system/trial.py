"""The trial directory ``<fileroot>/<exp>/<trial>/`` and the bootstrap file workers start from."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from system.wire import new_secret


@dataclasses.dataclass(frozen=True)
class TrialPaths:
    """Every path of one trial."""

    root: str

    @property
    def config(self) -> str:
        return os.path.join(self.root, "config.yaml")

    @property
    def bootstrap(self) -> str:
        return os.path.join(self.root, "bootstrap.json")

    @property
    def secret(self) -> str:
        return os.path.join(self.root, "secret")

    @property
    def summary(self) -> str:
        return os.path.join(self.root, "summary.json")

    @property
    def logs(self) -> str:
        return os.path.join(self.root, "logs")

    def worker_log(self, kind: str, index: int) -> str:
        return os.path.join(self.logs, f"{kind}-{index}.log")

    @staticmethod
    def of(fileroot: str, exp: str, trial: str) -> "TrialPaths":
        return TrialPaths(os.path.abspath(os.path.join(fileroot, exp, trial)))


def write_secret(path: str) -> bytes:
    """Create a fresh 32-byte per-trial secret, readable by the owner only (mode 0600)."""
    secret = new_secret()
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret


def read_secret(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclasses.dataclass
class Bootstrap:
    """What a worker process needs before the controller configures it: who it is, where the
    name-resolution backend lives, which interface to bind, and where the secret is."""

    exp: str
    trial: str
    experiment: str
    trial_dir: str
    interface: str
    """``cluster.interface``; empty: each worker picks its own node's address."""
    scheduler: str
    name_resolve: dict[str, Any]
    name_resolve_root: str
    rpc: dict[str, Any]
    heartbeat_ttl: float

    def write(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
        os.replace(tmp, path)

    @staticmethod
    def read(path: str) -> "Bootstrap":
        with open(path) as f:
            return Bootstrap(**json.load(f))


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def bind_host(interface: str, scheduler: str) -> str:
    """The address sockets bind to: the configured one, else loopback for the local scheduler
    and this node's address under Slurm."""
    if interface:
        return interface
    if scheduler == "local":
        return "127.0.0.1"
    import socket

    return socket.gethostbyname(socket.gethostname())


def name_resolve_root(cfg: Any) -> str:
    """Directory of the ``file`` name-resolution backend: ``name_resolve.file_root``, else
    ``<cluster.fileroot>/.name_resolve``."""
    return cfg.name_resolve.file_root or os.path.join(os.path.abspath(cfg.cluster.fileroot),
                                                      ".name_resolve")


def prepare_trial(cfg: Any, experiment_name: str, resolved_yaml: str) -> tuple[TrialPaths, bytes]:
    """Create the trial directory: resolved config, fresh secret (0600), bootstrap file."""
    from system.config import plain

    paths = TrialPaths.of(cfg.cluster.fileroot, cfg.exp, cfg.trial)
    os.makedirs(paths.logs, exist_ok=True)
    with open(paths.config, "w") as f:
        f.write(resolved_yaml)
    secret = write_secret(paths.secret)
    Bootstrap(exp=cfg.exp, trial=cfg.trial, experiment=experiment_name, trial_dir=paths.root,
              interface=cfg.cluster.interface, scheduler=cfg.scheduler.type.value,
              name_resolve=plain(cfg.name_resolve), name_resolve_root=name_resolve_root(cfg),
              rpc=plain(cfg.rpc), heartbeat_ttl=cfg.controller.heartbeat_ttl).write(paths.bootstrap)
    return paths, secret
