"""A worker applying the CPU set its scheduler chose (``RLSYS_CPUS``, see
:mod:`scheduler.cpu_plan`): every thread of the process is moved onto the set, and the thread
pools that size themselves by the CPU count (OpenMP, torch's intra-op pool) are sized to it.

Every thread, not only the calling one: ``sched_setaffinity(0)`` moves the calling thread alone,
and a worker forked by a warm spare may already run threads (a vLLM engine prepared ahead).
"""
from __future__ import annotations

import logging
import os
import sys

CPUS_ENV = "RLSYS_CPUS"
"""A worker's CPU set (``0-3,8``), set by the local scheduler, applied by the worker."""

log = logging.getLogger("cpu-binding")


def parse_ids(text: str) -> set[int]:
    """``0-3,8`` -> ``{0, 1, 2, 3, 8}`` (the scheduler checked the text)."""
    out: set[int] = set()
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def bind_from_env(environ: dict[str, str] | None = None) -> set[int] | None:
    """Move this process onto ``RLSYS_CPUS`` if set; returns the set (None: unbound)."""
    env = os.environ if environ is None else environ
    text = env.get(CPUS_ENV, "")
    if not text or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = parse_ids(text)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended
    n = str(len(cpus))
    os.environ["OMP_NUM_THREADS"] = n  # for OpenMP pools started from now on
    torch = sys.modules.get("torch")
    if torch is not None:  # (imported ahead by a warm spare)
        torch.set_num_threads(len(cpus))
    return cpus


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]
