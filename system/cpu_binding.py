"""A worker applying the CPU set its scheduler chose (``RLSYS_CPUS``, see
:mod:`scheduler.cpu_plan`): every thread of the process is moved onto the set, and the thread
pools that size themselves by the CPU count (OpenMP, torch's intra-op pool) are sized to it,
unless the user set ``OMP_NUM_THREADS`` (then that count is used for both).

Every thread, not only the calling one: ``sched_setaffinity(0)`` moves the calling thread alone,
and a worker forked by a warm spare may already run threads (a vLLM engine prepared ahead).
"""
from __future__ import annotations

import os
import re
import sys

from system.errors import ConfigError

CPUS_ENV = "RLSYS_CPUS"
"""A worker's CPU set (``0-3,8``), set by the local scheduler, applied by the worker."""
OMP_FROM_CPUS_ENV = "RLSYS_OMP_FROM_CPUS"
"""The ``OMP_NUM_THREADS`` a binding wrote itself (not the user's): a warm spare binds to its
group's CPUs, and the worker it forks binds again to its own; that second binding must size
the pools to the worker's set, not keep the group's count as if the user had set it."""


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``0-3,8`` -> ``(0, 1, 2, 3, 8)`` (sorted, no repeats); :class:`ConfigError` if
    malformed or empty."""
    out: set[int] = set()
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d{1,5})(?:-(\d{1,5}))?\s*", item)
        if m is None:
            raise ConfigError(f"{text!r} is not a CPU list such as 0-3,8")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ConfigError(f"{text!r}: range {lo}-{hi} runs backwards")
        out.update(range(lo, hi + 1))
    return tuple(sorted(out))


def bind_from_env(environ: dict[str, str] | None = None) -> set[int] | None:
    """Move this process onto ``RLSYS_CPUS`` if set; returns the set (None: unbound)."""
    env = os.environ if environ is None else environ
    text = env.get(CPUS_ENV, "")
    if not text or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = set(parse_cpu_list(text))
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended
    user = _user_threads()
    threads = user or len(cpus)  # a user's own OMP_NUM_THREADS wins
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for OpenMP pools started from now on
    if user is None:
        os.environ[OMP_FROM_CPUS_ENV] = str(threads)
    else:
        os.environ.pop(OMP_FROM_CPUS_ENV, None)
    torch = sys.modules.get("torch")
    if torch is not None:  # (imported ahead by a warm spare)
        torch.set_num_threads(threads)
    return cpus


def _user_threads() -> int | None:
    """``OMP_NUM_THREADS`` as the user set it (a positive count), else None (unset, or
    written by an earlier binding of this process or its parent: :data:`OMP_FROM_CPUS_ENV`)."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text == os.environ.get(OMP_FROM_CPUS_ENV):
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
