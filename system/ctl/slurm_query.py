"""``squeue`` and ``scancel`` for the operator tool: the state, pending reason and node of a
trial's recorded jobs, and cancelling them. Every call has a timeout; a missing or silent Slurm
is "no answer" (None), never an empty queue."""
from __future__ import annotations

import dataclasses
import subprocess
from typing import Sequence

from scheduler.slurm_cli import QUEUED_STATES
from scheduler.slurm_jobs import NamedJob, named_jobs

TIMEOUT = 30.0
"""Seconds one squeue or scancel may take."""


@dataclasses.dataclass(frozen=True)
class QueuedJob:
    """One ``squeue`` line."""

    job_id: str
    state: str
    """Slurm's own state word (``PENDING``, ``RUNNING``, ``CANCELLED``, ...)."""
    reason: str
    """Why it is pending (``Resources``, ``Priority``, ``BeginTime``, ...); empty otherwise."""
    node: str
    name: str

    @property
    def active(self) -> bool:
        return self.state in QUEUED_STATES


FORMAT = "%i|%T|%r|%N|%j"


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _parse(out: str) -> dict[str, QueuedJob]:
    """Lines of :data:`FORMAT`."""
    jobs = {}
    for line in out.splitlines():
        parts = line.strip().split("|", 4)
        if len(parts) == 5 and parts[0]:
            job_id, state, reason, node, name = parts
            reason = reason if state == "PENDING" and reason not in ("None", "(null)") else ""
            jobs[job_id] = QueuedJob(job_id, state.split(" ")[0], reason, node, name)
    return jobs


def queue(ids: Sequence[str], all_states: bool = False) -> dict[str, QueuedJob] | None:
    """The jobs of ``ids`` that Slurm still lists (``all_states``: ended ones it remembers
    too, else only those in the queue); None when squeue did not answer."""
    ids = [j for j in ids if j]
    if not ids:
        return {}
    states = ["--states=all"] if all_states else []
    r = _run(["squeue", "-h", *states, "-j", ",".join(ids), "-o", FORMAT])
    if r is None:
        return None
    if r.returncode != 0:
        if "Invalid job id" not in r.stderr:
            return None
        if len(ids) == 1:  # gone from Slurm's memory
            return {}
        out: dict[str, QueuedJob] = {}
        for job_id in ids:  # squeue refuses a whole list that names a purged job
            one = queue([job_id], all_states)
            if one is None:
                return None
            out.update(one)
        return out
    found = _parse(r.stdout)
    return {j: q for j, q in found.items() if all_states or q.active}


def mine() -> list[NamedJob] | None:
    """This user's queued jobs, with where each writes its output (``squeue -O``, parsed where
    the launcher parses it); None when squeue did not answer."""
    jobs = named_jobs(None, TIMEOUT)
    return None if jobs is None else [j for j in jobs if j.state in QUEUED_STATES]


def scancel(ids: Sequence[str], *flags: str) -> bool:
    """One ``scancel`` of ``ids``; whether it said it did."""
    if not ids:
        return True
    r = _run(["scancel", *flags, *ids])
    return r is not None and r.returncode == 0
