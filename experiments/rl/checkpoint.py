"""Atomic, durable checkpoint directories: ``<trial>/checkpoints/step_<N>/`` plus a ``latest``
pointer.

A checkpoint is written into ``step_<N>.tmp/`` by every party (model workers write and fsync
their engines, the master its own state), then the master lists every staged file with its size
and content digest in ``meta.json`` (the model workers digest what they wrote, each its share:
:mod:`system.digests`; the master the rest), fsyncs, renames the directory in one step and
replaces the ``latest`` file atomically (fsyncing the parent directory after each rename). A
crash at any point leaves the previous checkpoint as the newest complete one.

:meth:`CheckpointDir.latest` does not trust the pointer alone: it returns the newest checkpoint
that verifies (``meta.json`` readable, every listed file present with its size and a readable
structure, not marked corrupt) and logs a warning naming each newer one it skips, so a torn
checkpoint costs one checkpoint interval, not the whole run. Content that changed at the same
size is found when the checkpoint is restored: each model worker checks its share of the
digests (:meth:`CheckpointDir.check_content`), the master its own state's, and a checkpoint that
differs is marked corrupt; the restart that follows resumes from the one before it. Where
checkpoints exist but none verifies, it refuses (:class:`UnreadableCheckpoints`): resuming from
nothing would train from the base model again and prune them. The newest ``keep`` complete
checkpoints are kept.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import zipfile
from typing import Any, Collection

import msgpack

from system.digests import check_share, file_digest, list_files
from system.errors import ConfigError
from system.files import fsync_path

log = logging.getLogger("rl-checkpoint")

META = "meta.json"
POINTER = "latest"
CORRUPT = "CORRUPT"
"""A file a restoring worker writes into a checkpoint whose content differs from its digests
(the reason): :meth:`CheckpointDir.verify` then refuses it."""

_warned: set[tuple[str, str]] = set()
"""(checkpoint, problem) pairs this process named already (a launch asks several times)."""


class UnreadableCheckpoints(ConfigError):
    """A trial has checkpoints and none of them can be restored."""


class CorruptCheckpoint(RuntimeError):
    """A checkpoint's content differs from its digests (it is marked: a restart skips it)."""


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (not its directory: the caller renames it)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class CheckpointDir:
    def __init__(self, root: str, keep: int = 2) -> None:
        self.root = root
        self.keep = keep
        os.makedirs(root, exist_ok=True)

    def staging(self, step: int) -> str:
        path = os.path.join(self.root, f"step_{step}.tmp")
        if os.path.exists(path):
            shutil.rmtree(path)
        os.makedirs(path)
        return path

    def commit(self, step: int, meta: dict[str, Any],
               digests: dict[str, str] | None = None) -> str:
        """Publish the staged checkpoint of ``step`` (every party has written and fsynced its
        files into it). ``digests``: those of some of its files, taken by their writers; the
        others are digested here."""
        tmp, final = os.path.join(self.root, f"step_{step}.tmp"), self.path(step)
        files = list_files(tmp, skip=(META,))
        given = digests or {}
        sums = {name: given.get(name) or file_digest(os.path.join(tmp, name)) for name in files}
        write_durable(os.path.join(tmp, META), json.dumps(
            {**meta, "step": step, "files": files, "digests": sums}).encode())
        fsync_path(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.root)
        pointer = os.path.join(self.root, POINTER + ".tmp")
        write_durable(pointer, str(step).encode())
        os.replace(pointer, os.path.join(self.root, POINTER))
        fsync_path(self.root)
        self._prune(step)
        return final

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")

    def steps(self) -> list[int]:
        """Steps of the renamed (not staging) checkpoint directories, newest first."""
        return sorted((int(d[5:]) for d in os.listdir(self.root)
                       if d.startswith("step_") and d[5:].isdigit()), reverse=True)

    def latest(self) -> int | None:
        """The newest checkpoint that verifies, None when there is none at all; each newer,
        broken one is named in a warning (once per process). :class:`UnreadableCheckpoints`
        when there are checkpoints but none verifies."""
        problems: list[tuple[int, str]] = []
        for step in self.steps():
            problem = self.verify(step)
            if problem is None:
                for skipped, why in problems:
                    if (self.path(skipped), why) not in _warned:
                        _warned.add((self.path(skipped), why))
                        log.warning("checkpoint %s is unreadable (%s): falling back to step %d",
                                    self.path(skipped), why, step)
                return step
            problems.append((step, problem))
        if problems:
            shown = "; ".join(f"step_{s}: {why}" for s, why in problems[:3])
            shown += "; ..." if len(problems) > 3 else ""
            raise UnreadableCheckpoints(
                f"none of the {len(problems)} checkpoint(s) in {self.root} can be restored "
                f"({shown}): resuming would train from the base model again and delete them. "
                "Repair or move them away and launch again; or start over (recover=off "
                "recover.overwrite=true)")
        return None

    def verify(self, step: int) -> str | None:
        """Why checkpoint ``step`` cannot be restored, or None if it can."""
        directory = self.path(step)
        try:
            with open(os.path.join(directory, CORRUPT)) as f:
                return f"marked corrupt: {f.read().strip()}"
        except OSError:
            pass
        try:
            with open(os.path.join(directory, META)) as f:
                meta = json.load(f)
            files = meta["files"]
            if meta["step"] != step or not isinstance(files, dict):
                return f"{META} does not describe step {step}"
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{META}: {e}"
        for name, size in files.items():
            problem = _check_file(os.path.join(directory, name), size)
            if problem is not None:
                return f"{name}: {problem}"
        return None

    def check_content(self, step: int, rank: int = 0, world: int = 1, under: str = "",
                      mark: bool = True, only: Collection[str] | None = None) -> str | None:
        """Rank ``rank`` of ``world`` (the processes restoring checkpoint ``step``) checks its
        share of the files' digests (those ``under`` a folder, if given; ``only`` those files,
        if given): the first difference, or None. A difference marks the checkpoint corrupt
        (:data:`CORRUPT`; ``mark=False``: a reader that must not write to the trial), so that
        every process skips it from now on. A checkpoint written without digests has nothing
        to check."""
        directory = self.path(step)
        with open(os.path.join(directory, META)) as f:
            meta = json.load(f)
        digests = meta.get("digests")
        if not isinstance(digests, dict):
            return None
        prefix = under.rstrip("/") + "/" if under else ""
        digests = {k: v for k, v in digests.items()
                   if k.startswith(prefix) and (only is None or k in only)}
        problem = check_share(directory, digests, meta["files"], rank, world)
        if problem is not None and mark:
            self.mark_corrupt(step, problem)
        return problem

    def restorable(self, step: int, rank: int = 0, world: int = 1,
                   only: Collection[str] | None = None) -> str:
        """The directory of checkpoint ``step`` once this process checked its share of the
        content (:meth:`check_content`); :class:`CorruptCheckpoint` if it differs (the
        checkpoint is marked: the restart that follows resumes from the one before it)."""
        problem = self.check_content(step, rank, world, only=only)
        if problem is not None:
            raise CorruptCheckpoint(f"checkpoint {self.path(step)} is corrupt ({problem}): it "
                                    "is marked so, and a restart resumes from the one before "
                                    "it")
        return self.path(step)

    def mark_corrupt(self, step: int, why: str) -> None:
        """Mark checkpoint ``step`` corrupt, saying ``why`` (atomically: a reader sees the
        whole reason or no mark)."""
        path = os.path.join(self.path(step), CORRUPT)
        tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"  # (ranks on several hosts)
        try:
            write_durable(tmp, why.encode())
            os.replace(tmp, path)
            fsync_path(self.path(step))
        except OSError as e:  # (say, another user's trial, read-only to this one)
            log.error("checkpoint %s is corrupt (%s), and could not be marked so: %s",
                      self.path(step), why, e)
            return
        log.error("checkpoint %s is corrupt (%s): marked, it is skipped from now on",
                  self.path(step), why)

    def _prune(self, newest: int) -> None:
        """Keep ``newest`` and the complete checkpoints before it, up to ``keep`` in all; drop
        directories after it (a timeline this resumed run replaced) and stale staging ones."""
        kept = 0
        for s in self.steps():
            if s == newest or (s < newest and (self.keep <= 0 or kept < self.keep)
                               and self.verify(s) is None):
                kept += 1
                continue
            shutil.rmtree(self.path(s), ignore_errors=True)
        self.discard_staging()

    def discard_staging(self) -> None:
        """Remove the staging directories of checkpoints never committed (a crash, a full
        disk): called when no party is writing one (after a commit; when the training loop
        starts, before it asks for any)."""
        for d in os.listdir(self.root):
            if d.startswith("step_") and d.endswith(".tmp"):
                shutil.rmtree(os.path.join(self.root, d), ignore_errors=True)


def _check_file(path: str, size: int) -> str | None:
    """Why the file at ``path`` is not the one committed with ``size`` bytes, or None. Checks
    what is cheap: presence, size, and the structure of formats that describe themselves."""
    try:
        actual = os.path.getsize(path)
        if actual != size:
            return f"{actual} bytes, committed with {size}"
        if path.endswith(".json"):
            with open(path) as f:
                json.load(f)
        elif path.endswith(".msgpack"):
            with open(path, "rb") as f:
                msgpack.unpackb(f.read())
        elif path.endswith(".safetensors"):
            return _check_safetensors(path, actual)
        elif path.endswith(".pt"):  # torch.save writes a zip archive
            with zipfile.ZipFile(path) as z:
                z.namelist()
    except (OSError, ValueError, zipfile.BadZipFile, msgpack.UnpackException) as e:
        return str(e) or type(e).__name__
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a structure gone wrong
        return f"malformed: {type(e).__name__}: {e}"
    return None


def _check_safetensors(path: str, size: int) -> str | None:
    """A safetensors file's header parses and its tensors end exactly at the end of the file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            return "no safetensors header"
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            return "safetensors header longer than the file"
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        return "safetensors header is not a map"
    end = 0
    for name, v in header.items():
        if name == "__metadata__":
            continue
        offsets = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int and o >= 0 for o in offsets)):
            return f"safetensors header: tensor {name[:60]!r} has no valid data_offsets"
        end = max(end, offsets[1])
    return None if 8 + n + end == size else "safetensors data does not fill the file"
