"""Worker jobs that outlived the controller of an earlier run of the same trial.

A controller that died without stopping its jobs (``kill -9`` of the launcher, a lost login
node, a ``--detach`` controller whose node failed and that Slurm requeued) leaves them queued or
running until their workers judge it gone (``controller.orphan_timeout``). A new run of the
trial started meanwhile would share the trial's name-resolution keys with them: old workers
would see its controller's key and carry on, registering beside the new ones. The new
controller holds the trial's lock, so every worker job of the trial still in the queue is such
a leftover: it is cancelled before anything is submitted.
"""
from __future__ import annotations

import os
import time
from typing import Collection, Sequence

from scheduler.slurm_cli import ENDING_STATES, QUEUED_STATES
from scheduler.slurm_jobs import NamedJob, cancel_until_gone, het_leader, named_jobs, writes_in
from system.errors import SchedulerError

LEFTOVER_STATES = QUEUED_STATES - ENDING_STATES
"""Slurm states of a job whose workers run, or will (not ``COMPLETING``: they have ended,
and a cancel could not hurry it)."""


def leftover_jobs(jobs: Sequence[NamedJob], exp: str, trial: str,
                  logs_dirs: Collection[str]) -> list[NamedJob]:
    """Those of ``jobs`` (this user's queue) that are worker jobs of trial ``exp``/``trial``
    writing their batch log to one of ``logs_dirs`` (pure): named ``<exp>_<trial>:<label>``,
    the controller's own job excepted, in a :data:`LEFTOVER_STATES` state. A trial of the same
    name under another file root writes its logs elsewhere and is not touched. Slurm 22.05
    shows the ``--output`` pattern, ``%`` doubled; later ones the path."""
    prefix = f"{exp}_{trial}:"
    return [j for j in jobs
            if j.name.startswith(prefix) and j.name != prefix + "controller"
            and j.state in LEFTOVER_STATES and writes_in(j, logs_dirs)]


def cancel_leftovers(exp: str, trial: str, logs_dirs: Sequence[str], deadline_s: float,
                     timeout: float) -> list[str]:
    """Cancel the :func:`leftover_jobs` of trial ``exp``/``trial`` (batch logs in one of
    ``logs_dirs``) and return their ids once the queue holds none of them; none when squeue
    does not answer (the launch goes on, as it did before this look). Raises
    :class:`SchedulerError` naming those still queued ``deadline_s`` seconds later."""
    found = named_jobs(None, timeout)
    dirs = {p for d in logs_dirs for p in (d, os.path.realpath(d))}
    jobs = leftover_jobs(found or [], exp, trial, dirs)
    ids = sorted({het_leader(j.job_id) for j in jobs}, key=lambda j: (len(j), j))
    if not ids:
        return []
    left = cancel_until_gone(ids, time.monotonic() + deadline_s, timeout)
    if left:
        raise SchedulerError(
            f"job(s) {', '.join(left)} of an earlier run of {exp}/{trial}, whose controller "
            f"died, are still in the queue {deadline_s:.0f}s after scancel; cancel them "
            f"(scancel {' '.join(left)}) and launch again")
    return ids
