"""A worker's file descriptors: as many as the node allows, and watched.

Every TCP connection a peer opens to a worker's sockets costs the worker a file descriptor,
whoever the peer is (ZeroMQ accepts before any authentication). A worker raises its soft
``RLIMIT_NOFILE`` to the hard limit at start-up (:func:`raise_fd_limit`), and
:class:`FdWatch` tells when descriptors run short, so a worker that runs out fails with that
reason instead of silently losing its heartbeat (whose refresh needs a descriptor).
"""
from __future__ import annotations

import errno
import os
import resource
import time

FD_CAP = 1 << 20
"""Soft limit taken when the hard limit is unlimited."""


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard limit; returns ``(soft, hard)`` after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft, hard


def open_fds() -> int | None:
    """Descriptors open in this process (None where ``/proc`` cannot tell). Raises
    ``OSError(EMFILE)`` when there is none left to look."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir used
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise
        return None


class FdWatch:
    """Call :meth:`check` periodically: it returns ``"low"`` when more than ``warn_fraction`` of
    the soft limit is in use, ``"exhausted"`` once none has been free for ``grace`` seconds,
    else ``None``; :attr:`detail` says how many are open."""

    def __init__(self, grace: float = 1.0, warn_fraction: float = 0.9) -> None:
        self.grace = grace
        self.warn_fraction = warn_fraction
        self.detail = ""
        self._out_since: float | None = None

    def check(self) -> str | None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        try:
            n = open_fds()
        except OSError:
            n = soft
        if n is None:
            return None
        self.detail = f"{n} file descriptors open, limit {soft}"
        if n < soft - 1:
            self._out_since = None
            return "low" if n > self.warn_fraction * soft else None
        now = time.monotonic()
        if self._out_since is None:
            self._out_since = now
        return "exhausted" if now - self._out_since >= self.grace else "low"
