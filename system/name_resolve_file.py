"""The ``file`` name-resolution backend: a directory, possibly on NFS (atomic write-then-rename,
exclusive create by ``link``, no file locks, TTLs as expiry times checked on read)."""
from __future__ import annotations

import errno
import json
import os
import time
import uuid
from typing import Iterator

from system.errors import NameEntryExists, NameResolveError, NameServiceRefused
from system.name_resolve_api import NameResolve
from system.private_files import ensure_owned_dir, ensure_shared_dir


REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
"""Why a write under the file backend's root fails whatever the retries (the next write, and a
restarted process's, would fail alike)."""


class FileNameResolve(NameResolve):
    """Directory backend. Each key is a directory holding an ``ENTRY`` JSON file
    ``{"value": ..., "expires": unix_time|null}``; writes go to a temp file renamed into place.
    ``root`` is shared by every user of a file root (created 1777, like ``/tmp``, when absent);
    this user's entries live in ``root/<uid>/``, a directory of theirs with mode 0700."""

    ENTRY = "ENTRY"

    def __init__(self, root: str, *, secret: bytes | None) -> None:
        super().__init__(secret)
        self.shared = os.path.abspath(root)
        self.root = os.path.join(self.shared, str(os.getuid()))
        self._make_root()

    def _make_root(self) -> None:
        """The shared directory (1777) and this user's own in it (0700), checked as theirs;
        made again where deleted meanwhile (then every entry is gone: the keep-alive refresh
        finds out and adds back what this process holds)."""
        shared = self.shared
        try:
            ensure_shared_dir(shared)
            ensure_owned_dir(self.root, 0o700, "your name-resolution directory")
        except PermissionError as e:
            raise NameResolveError(
                f"cannot create your name-resolution directory in {shared} ({e.strerror}): its "
                "owner can make it shared (chmod 1777), or set name_resolve.file_root to a "
                "directory of yours") from e
        except OSError as e:  # a read-only file system, a path under a file, /proc...
            raise NameResolveError(
                f"cannot create your name-resolution directory in {shared} "
                f"({e.strerror or e}): set name_resolve.file_root (by default under "
                "cluster.fileroot) to a writable directory") from e

    PUT_TRIES = 200
    """Tries to make an entry's directory and its temporary file, against concurrent prunes
    (after the first few, each a millisecond apart: a CI run under load saw 20 back-to-back
    tries lose to sibling keys' deletes)."""

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"), self.ENTRY)

    def _put(self, key: str, value: str, ttl: float | None, replace: bool) -> None:
        try:
            self._write(key, value, ttl, replace)
        except OSError as e:
            if e.errno not in REFUSED:
                raise
            fix = ("make room on its file system" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                   else "make it writable")
            raise NameServiceRefused(f"the name-resolution directory {self.root} refused a "
                                     f"write ({e.strerror}): {fix}, or set "
                                     "name_resolve.file_root") from None

    def _write(self, key: str, value: str, ttl: float | None, replace: bool) -> None:
        path = self._path(key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        body = json.dumps({"value": value, "expires": None if ttl is None else time.time() + ttl})
        for attempt in range(self.PUT_TRIES):
            try:
                if not os.path.isdir(self.root):  # (not with the user's mode: see _make_root)
                    self._make_root()
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                break
            except FileNotFoundError:  # a delete of a sibling key pruned a directory of ours
                if attempt == self.PUT_TRIES - 1:  # as it went empty; once tmp is in it, it stays
                    raise
                if attempt >= 3:  # let the sibling's delete finish its pruning
                    time.sleep(0.001)
        try:  # (a write that fails, a full disk, leaves no temporary file behind either)
            with os.fdopen(fd, "w") as f:
                f.write(body)
            if replace:
                os.replace(tmp, path)
                return
            try:  # exclusive create: link() fails if the target exists (atomic on NFS too)
                os.link(tmp, path)
                return
            except FileExistsError:
                if self._sealer.open(key, self._read(path)[0]) is not None:
                    raise NameEntryExists(key) from None
                os.replace(tmp, path)  # the old entry had expired (or was not authentic)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _read(path: str) -> tuple[str | None, float | None]:
        """The value and expiry in the entry file ``path``; ``(None, None)`` if absent or
        expired."""
        try:
            with open(path) as f:
                entry = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            return None, None  # torn or foreign file: treat as absent
        if not isinstance(entry, dict):
            return None, None
        expires = entry.get("expires")
        if not isinstance(expires, (int, float)):
            expires = None
        elif time.time() > expires:
            return None, None
        value = entry.get("value")
        return (value, expires) if isinstance(value, str) else (None, None)

    def _get(self, key: str) -> str | None:
        return self._read(self._path(key))[0]

    def _get_many(self, keys: list[str]) -> list[tuple[str | None, float | None]]:
        return [self._read(self._path(k)) for k in keys]

    def _delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        # prune now-empty directories up to the root
        d = os.path.dirname(path)
        while d != self.root and d.startswith(self.root):
            try:
                os.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)
        return True

    def _keys_under(self, prefix: str) -> Iterator[str]:
        top = os.path.join(self.root, *prefix.split("/"))
        if not os.path.isdir(top):
            return
        for dirpath, _dirs, files in os.walk(top):
            if self.ENTRY in files:
                yield os.path.relpath(dirpath, self.root).replace(os.sep, "/")
