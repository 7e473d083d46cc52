"""``squeue`` and ``scancel`` for the operator tool: the state, pending reason and node of a
trial's recorded jobs, and cancelling them. Every call has a timeout; a missing or silent Slurm
is "no answer" (None), never an empty queue."""
from __future__ import annotations

import dataclasses
import getpass
import os
import subprocess
from typing import Sequence

TIMEOUT = 30.0
"""Seconds one squeue or scancel may take."""

ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
          "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT", "RESIZING",
          "STOPPED")
"""Raw Slurm states of a job that is still in the queue."""


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
    stdout: str = ""
    """Where the job's batch output goes (``squeue -O StdOut``): Slurm 22.05 prints the
    ``--output`` pattern as given (``%%`` for a literal ``%``), later versions expand it; empty
    where the query did not ask for it."""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE


FORMAT = "%i|%T|%r|%N|%j"
LONG_FORMAT = "JobArrayID:0|,State:0|,Reason:0|,NodeList:0|,Name:0|,StdOut:0"
""":data:`FORMAT` and the job's ``StdOut`` last (it may hold ``|``), for ``squeue -O``
(``JobArrayID`` writes a heterogeneous job's component ``12+1`` as ``%i`` does; ``JobID``
would write its own id). Each field is as wide as it needs (``:0``), ended by ``|``."""


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _parse(out: str) -> dict[str, QueuedJob]:
    """Lines of :data:`FORMAT`, or of :data:`LONG_FORMAT` (a sixth field: ``StdOut``)."""
    jobs = {}
    for line in out.splitlines():
        parts = line.strip().split("|", 5)
        if len(parts) >= 5 and parts[0]:
            job_id, state, reason, node, name = parts[:5]
            reason = reason if state == "PENDING" and reason not in ("None", "(null)") else ""
            stdout = parts[5] if len(parts) == 6 else ""
            jobs[job_id] = QueuedJob(job_id, state.split(" ")[0], reason, node, name, stdout)
    return jobs


def stdout_under(stdout: str, root: str) -> bool:
    """Whether a job's ``StdOut`` (:attr:`QueuedJob.stdout`) lies under the directory ``root``
    (pure): as Slurm expands it, or as the pattern the job scripts write (``%`` doubled,
    :func:`scheduler.slurm_render.slurm_literal`). A relative or empty one never does."""
    if not os.path.isabs(stdout) or not os.path.isabs(root):
        return False
    path = os.path.normpath(stdout)
    return any(path.startswith(os.path.join(os.path.normpath(r), "")) for r in
               {root, root.replace("%", "%%")})


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


def mine() -> dict[str, QueuedJob] | None:
    """This user's queued jobs, with where each writes its output; None when squeue did not
    answer."""
    r = _run(["squeue", "-h", "-u", getpass.getuser(), "-O", LONG_FORMAT])
    if r is None or r.returncode != 0:
        return None
    return {j: q for j, q in _parse(r.stdout).items() if q.active}


def scancel(ids: Sequence[str], *flags: str) -> bool:
    """One ``scancel`` of ``ids``; whether it said it did."""
    if not ids:
        return True
    r = _run(["scancel", *flags, *ids])
    return r is not None and r.returncode == 0
