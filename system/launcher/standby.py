"""The spare's side of :mod:`scheduler.spares`: warm up, then fork a worker for each activation.

Also names every worker process ``kind/index`` (``/proc/PID/comm``, what ``ps`` and ``top``
show), since a spare's command line cannot say which worker it became; a spare is
``warm/kind`` while it imports and ``spare/kind`` once it is ready (15 bytes at most).
"""
from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import time
from typing import Callable

from scheduler.spares import Activation, Forked
from system.errors import ConfigError

log = logging.getLogger("standby")

_PR_SET_NAME = 15
_PR_SET_PDEATHSIG = 1


def set_process_name(name: str) -> None:
    """``/proc/self/comm`` = ``name`` (the kernel keeps 15 bytes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def warm(imports: Callable[[], None] | None) -> None:
    """Run the kind's warm-up imports now, on this (the worker's own) thread at its own
    priority: imports made on a lower-priority thread left torch's compute threads at that
    priority (training ran 10x slower). Best effort: an import that fails here fails for real,
    and is reported, where the worker needs it."""
    t0 = time.monotonic()
    if imports is not None:
        try:
            imports()
        except Exception as e:  # noqa: BLE001 - a warm-up only
            log.warning("warm-up failed: %s: %s", type(e).__name__, e)
    log.info("warm in %.1fs; waiting", time.monotonic() - t0)


def fork_workers() -> Activation | None:
    """The spare's loop: for each activation line on stdin fork a child that becomes that
    worker (this returns its :class:`Activation` in the child), answer the child's pid on
    stdout, and later its exit code (the spare is its parent and reaps it). Returns None in the
    spare when the scheduler went away (end of stdin); a malformed line is logged and skipped.

    The spare only imported modules: it runs no threads of its own, so a fork copies a
    quiescent process (torch's and vLLM's pools start in the child, when it first needs them).
    """
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        ready, _, _ = select.select([0, *children], [], [])
        for fd in ready:
            if fd != 0:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _answer(Forked(pid, os.waitstatus_to_exitcode(status)))
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return None
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                act = Activation.parse(line.decode(errors="replace"))
            except ConfigError as e:
                log.error("not an activation: %s", e)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            spare = os.getpid()
            pid = os.fork()
            if pid == 0:
                for fd in children:
                    os.close(fd)
                _become(act, spare)
                return act
            children[os.pidfd_open(pid)] = pid
            _answer(Forked(pid))


def _answer(a: Forked) -> None:
    os.write(1, a.line())


def _become(act: Activation, spare: int) -> None:
    """In the forked child: lead a session of its own (stopped as a group, like every local
    worker), die with the spare (which dies with the launcher), take the activation's
    environment and log file, read nothing from the spare's stdin."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != spare:  # the spare died between the fork and the prctl
        os._exit(1)
    os.environ.update(act.env)
    fd = os.open(act.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
