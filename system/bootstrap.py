"""What a worker process reads at start-up, before the controller configures it: the bootstrap
file of its trial (who it is, where name resolution lives, which interface to bind) and the
trial's secret."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any


@dataclasses.dataclass
class Bootstrap:
    """The trial's ``bootstrap.json`` (written by the launcher, read by every worker)."""

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
    orphan_timeout: float = 60.0
    """Seconds without the controller's liveness key after which a worker stops by itself."""

    def write(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=1)
        os.replace(tmp, path)

    @staticmethod
    def read(path: str) -> "Bootstrap":
        with open(path) as f:
            return Bootstrap(**json.load(f))


def read_secret(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def bind_host(interface: str, scheduler: str) -> str:
    """The address sockets bind to: the configured one, else loopback for the local scheduler
    and this node's address under Slurm."""
    if interface:
        return interface
    if scheduler == "local":
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())
