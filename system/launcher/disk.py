"""A full file system as the cause of a failure: the trial's files (checkpoints, logs, the
workers' error reports) all live under its directory, so when that file system fills up a worker
fails writing (a checkpoint: ``unexpected pos``, ``No space left on device``), often without
being able to say so (its report and log need space too). A restart would fail the same way.

:func:`full_disk_cause` reads how much space is left (``statvfs``) and how much the largest
checkpoint takes (space an unfinished checkpoint holds counts as free: a restart removes it);
:func:`judge_space` is the pure rule. A used-up quota (``EDQUOT``) is not in ``statvfs``, which
reports the file system's space, not the user's: it is seen in the failure's own text (a
worker's report or its log's last lines) or when a small write under the trial directory, as
the workers' user, is refused (:func:`write_refused`). The same probe names a trial directory
(or its checkpoints) that cannot be written at all (made read-only, immutable, another user's
mode): a restart fails the same way there too.
"""
from __future__ import annotations

import errno
import os
import tempfile

from system.errors import WorkerFailure, first_line

MIN_FREE = 16 << 20
"""Below this many free bytes the file system counts as full even before any checkpoint."""

PROBE = 1 << 20
"""Bytes :func:`write_refused` writes (and removes) to see whether the user may still write."""

QUOTA = os.strerror(errno.EDQUOT)
"""How a used-up quota reads in an ``OSError`` (``[Errno 122] Disk quota exceeded``)."""

UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
"""A write refused whatever the space: permissions, an immutable directory, a read-only mount."""


class FullDisk(WorkerFailure):
    """A failure named after the trial's file system, full or not writable (never recovered:
    ``config`` is set)."""


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
    """``failure`` named after a full file system or a used-up quota under the trial directory
    ``root`` (:func:`space_cause`), not to be recovered (a restart would fail the same way);
    else ``failure`` itself."""
    if isinstance(failure, FullDisk) or failure.worker is None:  # (a timeout, say)
        return failure
    places = {os.path.realpath(root), os.path.realpath(checkpoints)
              if os.path.isdir(checkpoints) else os.path.realpath(root)}
    try:  # (checkpoints may be a link to another file system: the fuller one counts)
        free = min(_free(p) for p in places)
        need, staged = checkpoint_sizes(checkpoints)
    except OSError:
        return failure
    refused = None
    if not judge_space(free + staged, need):  # (no need to write when statvfs says it all)
        refused = next((e for e in map(write_refused, sorted(places)) if e is not None), None)
    cause = space_cause(root, free, staged, need, refused, str(failure))
    if cause is None:
        return failure
    first = first_line(failure)
    return FullDisk(f"{cause}, then launch the trial again: it continues from its latest "
                    f"checkpoint\nthen {first}", failure.worker, failure.log_path,
                    also=failure.also, config=True)


def space_cause(root: str, free: int, staged: int, need: int, refused: OSError | None,
                text: str) -> str | None:
    """Why the trial directory ``root`` cannot take the next checkpoint, or None: a probe
    write there was ``refused`` whatever the space (:data:`UNWRITABLE`); its file
    system has too little space (``free`` bytes, ``staged`` more once the unfinished
    checkpoint is removed, ``need`` for the largest checkpoint); a probe write there was
    ``refused`` for want of space (a quota, which ``free`` does not show); or the failure's
    ``text`` says a quota is used up (somewhere a worker writes)."""
    if judge_space(free + staged, need):
        return (f"the file system of the trial directory {root} is full ({_mib(free + staged)}"
                f" free once the unfinished checkpoint is removed; the largest checkpoint "
                f"takes {_mib(need)}): free space")
    if refused is not None and refused.errno in UNWRITABLE:
        where = os.path.dirname(refused.filename) if isinstance(refused.filename, str) else root
        return (f"the workers cannot write under the trial directory: {where} refuses a new "
                f"file ({refused.strerror}): make it writable by the trial's user")
    if refused is not None and refused.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"writing under the trial directory {root} fails: {refused.strerror} (the file "
                f"system shows {_mib(free)} free: a quota, or its inodes, are used up): free "
                "space or raise the quota")
    if QUOTA in text:
        return (f"a worker failed with {QUOTA!r}: a quota is used up (on the trial directory's "
                f"file system or on another one that worker writes; its log names the file): "
                f"free space or raise the quota")
    return None


def write_refused(directory: str) -> OSError | None:
    """The error writing :data:`PROBE` bytes into a new file in ``directory`` (and syncing
    them: a quota may be charged only then) raised, the file removed again; None when the
    write succeeded or the directory is not there."""
    if not os.path.isdir(directory):
        return None
    try:
        fd, path = tempfile.mkstemp(prefix=".space-probe-", dir=directory)
    except OSError as e:
        return e
    refused: OSError | None = None
    try:
        data = memoryview(bytes(PROBE))
        while data:  # (a write short of space writes what fits; the next one fails)
            data = data[os.write(fd, data):]
        os.fsync(fd)
    except OSError as e:
        refused = e
    try:  # (NFS may report a deferred failure at close)
        os.close(fd)
    except OSError as e:
        refused = refused or e
    try:
        os.unlink(path)
    except OSError:
        pass
    return refused


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
