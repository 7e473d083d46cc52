"""The spare's side of :mod:`scheduler.spares`: warm up, wait to be told which worker to be.

Also names every worker process ``kind/index`` (``/proc/PID/comm``, what ``ps`` and ``top``
show), since a spare's command line cannot say which worker it became; a spare is
``warm/kind`` while it imports and ``spare/kind`` once it is ready (15 bytes at most).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Callable

from scheduler.spares import Activation
from system.errors import ConfigError

log = logging.getLogger("standby")

_PR_SET_NAME = 15


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


def wait_for_activation() -> Activation | None:
    """Block until the scheduler hands this spare its worker (None: the scheduler went away,
    or sent something that is not an activation); then take its environment and log file."""
    line = sys.stdin.readline()
    if not line:
        return None
    try:
        act = Activation.parse(line)
    except ConfigError as e:
        log.error("not an activation: %s", e)
        return None
    os.environ.update(act.env)
    fd = os.open(act.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return act
