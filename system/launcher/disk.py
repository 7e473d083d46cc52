"""A full file system as the cause of a failure: the trial's files (checkpoints, logs, the
workers' error reports) all live under its directory, so when that file system fills up a worker
fails writing (a checkpoint: ``unexpected pos``, ``No space left on device``), often without
being able to say so (its report and log need space too). A restart would fail the same way.

:func:`full_disk_cause` reads how much space is left (``statvfs``) and how much the largest
checkpoint takes (space an unfinished checkpoint holds counts as free: a restart removes it);
:func:`judge_space` is the pure rule. A quota (``EDQUOT``) is not seen: ``statvfs`` reports
the file system's space, not the user's.
"""
from __future__ import annotations

import os

from system.errors import WorkerFailure

MIN_FREE = 16 << 20
"""Below this many free bytes the file system counts as full even before any checkpoint."""


class FullDisk(WorkerFailure):
    """A failure named after a full file system (never recovered: ``config`` is set)."""


def judge_space(free: int, checkpoint: int) -> bool:
    """Whether ``free`` bytes cannot hold the next checkpoint (about ``checkpoint`` bytes, the
    largest so far, 0 for none) and the files written beside it (:data:`MIN_FREE`)."""
    return free < checkpoint + MIN_FREE


def checkpoint_sizes(checkpoints: str) -> tuple[int, int]:
    """Bytes of the largest checkpoint directory under ``checkpoints`` (committed or staged),
    and of the staged ones (``step_<N>.tmp``: never committed, removed when the trial starts
    again, so a restart has that space back); 0, 0 if none."""
    if not os.path.isdir(checkpoints):
        return 0, 0
    largest = staged = 0
    for entry in os.scandir(checkpoints):
        if entry.is_dir(follow_symlinks=False):
            size = _tree_size(entry.path)
            largest = max(largest, size)
            if entry.name.endswith(".tmp"):
                staged += size
    return largest, staged


def _tree_size(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def full_disk_cause(failure: WorkerFailure, root: str, checkpoints: str) -> WorkerFailure:
    """``failure`` named after a full file system under the trial directory ``root``, not to
    be recovered (a restart would fail the same way), when too little space is left; else
    ``failure`` itself."""
    if isinstance(failure, FullDisk) or failure.worker is None:  # (a timeout, say)
        return failure
    try:  # (checkpoints may be a link to another file system: the fuller one counts)
        free = min(_free(root), _free(os.path.realpath(checkpoints)) if
                   os.path.isdir(checkpoints) else _free(root))
        need, staged = checkpoint_sizes(checkpoints)
    except OSError:
        return failure
    if not judge_space(free + staged, need):
        return failure
    first = str(failure).splitlines()[0]
    return FullDisk(
        f"the file system of the trial directory {root} is full ({_mib(free + staged)} free "
        f"once the unfinished checkpoint is removed; the largest checkpoint takes "
        f"{_mib(need)}): free space, then launch the trial again: it "
        f"continues from its latest checkpoint\nthen {first}", failure.worker,
        failure.log_path, also=failure.also, config=True)


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
