"""One launcher or controller per trial: an exclusive ``flock`` on ``<trial>/lock``, held for
the trial's life by the process that runs its controller (the launcher, or the controller's own
job with ``--detach``). The kernel drops the lock when that process ends, however it ends, so
running the same command again afterwards (to continue the trial) just works; a second launch
while the trial runs is refused with one line naming the holder.

Linux NFS clients turn ``flock`` into a whole-file POSIX lock that the server arbitrates, so the
lock holds across nodes unless the file root is mounted with ``local_lock=flock``/``all``.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from typing import IO

from system.errors import RLSystemError, TrialLocked

LOCK_MODE = 0o600
"""Never group-readable: anyone who can open the file can hold a shared lock on it."""


def holder_record(mode: str = "train") -> dict[str, str | int]:
    """Who holds the lock: this process, its host, since when, its Slurm job if any, and the
    run's ``mode`` (``train``, or ``eval``: an evaluation holds its trial's lock)."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""), "mode": mode}


def describe_holder(text: str) -> str:
    """``pid 123 on host n1 since ... (Slurm job 55)`` from a lock file's record."""
    try:
        rec = json.loads(text)
        where = f"pid {rec['pid']} on host {rec['host']} since {rec['since']}"
    except (ValueError, KeyError, TypeError):
        return "a process that is still starting"
    return where + (f" (Slurm job {rec['slurm_job']})" if rec.get("slurm_job") else "")


class TrialLock:
    """The held lock of one trial; :meth:`release` (or the end of the process) frees it."""

    def __init__(self, path: str, file: IO[str]) -> None:
        self.path = path
        self._file: IO[str] | None = file

    @staticmethod
    def acquire(path: str, trial: str, mode: str = "train") -> "TrialLock":
        """Take the lock of ``trial`` at ``path`` for a run of ``mode``, or raise
        :class:`TrialLocked` naming the process that holds it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, LOCK_MODE)
        f = os.fdopen(fd, "r+")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(f.read())
            f.close()
            raise TrialLocked(f"trial {trial} is already running: held by {holder}; stop it or "
                              f"wait for it to end (lock: {path})") from None
        except OSError as e:  # ENOLCK: an NFS mount without lock support (nolock)
            f.close()
            raise RLSystemError(f"cannot lock {path} ({e.strerror}): the file root's filesystem "
                                "does not support file locks; two launches of this trial could "
                                "not be told apart") from e
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps(holder_record(mode)) + "\n")
            f.flush()
        except OSError as e:  # ENOSPC, EDQUOT: it was "[Errno 28] No space left on device"
            try:
                f.close()  # (the lock goes with it)
            except OSError:
                pass
            raise RLSystemError(f"cannot write the trial's lock file {path} ({e.strerror}): "
                                "make room on its file system (cluster.fileroot) and launch "
                                "again") from e
        return TrialLock(path, f)

    def release(self) -> None:
        """Free the lock (the file stays: removing it would let a later launcher lock a new file
        while a third still waits on the old one)."""
        if self._file is not None:
            self._file.truncate(0)
            self._file.flush()
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None
