"""What a worker process reads at start-up, before the controller configures it: the bootstrap
file of its trial (who it is, where name resolution lives, which interface to bind, which file
modes to create) and the trial's secret, checked to be the user's own and private."""
from __future__ import annotations

import dataclasses
import json
import socket
from typing import Any

from system.private_files import (check_private_parent, file_mode, read_private_file,
                                  write_private)


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
    group_readable: bool = False
    """``cluster.group_readable``: the trial's files are 0640/0750 instead of 0600/0700."""
    mode: str = "train"
    """``train``, or ``eval``: an evaluation of the checkpoints of the trial in
    :attr:`evaluated_dir` (whose ``eval/`` subdirectory is then :attr:`trial_dir`)."""
    evaluated_dir: str = ""
    """With ``mode=eval``: the directory of the trial whose checkpoints are evaluated."""
    preempt_warning: float = 0.0
    """Seconds between a job's time-limit warning (SIGUSR2) and its end:
    ``scheduler.slurm.signal_seconds`` under Slurm; 0: no such warning (the local scheduler)."""
    controller_stop_grace: float | None = None
    """``scheduler.stop_grace`` where a detached controller requeues its own job at its warning
    (it then waits less for the checkpoint:
    :func:`workers.checkpoint_window.controller_checkpoint_wait`); None: no such controller."""

    def write(self, path: str) -> None:
        write_private(path, json.dumps(dataclasses.asdict(self), indent=1).encode(),
                      file_mode(self.group_readable))

    @staticmethod
    def read(path: str) -> "Bootstrap":
        with open(path) as f:
            return Bootstrap(**json.load(f))


def read_secret(path: str) -> bytes:
    """The trial's secret: a regular file of this user with mode 0600, in a directory of theirs
    nobody else can write (:class:`~system.errors.UnsafeFileError` otherwise: a secret someone
    else wrote or swapped in would let them forge frames and name-resolution entries)."""
    check_private_parent(path, "the trial's secret")
    return read_private_file(path, "the trial's secret", (0o600,))


def bind_host(interface: str, scheduler: str) -> str:
    """The address sockets bind to: the configured one, else loopback for the local scheduler
    and this node's address under Slurm."""
    if interface:
        return interface
    if scheduler == "local":
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())
