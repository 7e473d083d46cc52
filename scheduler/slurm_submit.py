"""``sbatch`` of one job, and adopting a job Slurm queued without saying so.

An ``sbatch`` that cannot reach Slurm's controller (overloaded, stalled) gives up after its
message time-out, but the controller may still take the request once it answers: the job is
queued and nobody tracks it (it ran until its workers judged their controller gone; a recovery
that went on submitted the group again beside it). So after such a failure the queue is
searched, for :data:`ADOPT_WAIT` seconds, for a job of that name writing its batch log where this
one would, and one found is adopted as if ``sbatch`` had named it; a name not found then is
looked for again before it is next submitted (:func:`submit`)."""
from __future__ import annotations

import logging
import time
from typing import Collection

from scheduler.slurm_cli import last_error, parse_sbatch_parsable, unreachable
from scheduler.slurm_cli import run as _run
from scheduler.slurm_jobs import het_leader, named_jobs
from scheduler.slurm_leftovers import leftover_jobs
from system.errors import SchedulerError

log = logging.getLogger("slurm")

ADOPT_WAIT = 30.0
"""Seconds the queue is searched for a job an unanswered ``sbatch`` may have queued."""

LOOK_EVERY = 2.0
QUERY_TIMEOUT = 15.0


def queued_as(name: str, logs_dir: str, exp: str, trial: str,
              known: Collection[str], timeout: float = QUERY_TIMEOUT) -> list[str] | None:
    """Ids (leaders) of this user's queued jobs named ``name`` whose batch log is in
    ``logs_dir``, but ``known`` ones; None when squeue does not answer."""
    jobs = named_jobs(name, timeout)
    if jobs is None:
        return None
    return sorted({het_leader(j.job_id) for j in leftover_jobs(jobs, exp, trial, [logs_dir])
                   if j.name == name} - set(known), key=lambda j: (len(j), j))


def adopt(name: str, logs_dir: str, exp: str, trial: str, known: Collection[str],
          wait: float) -> str | None:
    """The job queued as ``name`` (see :func:`queued_as`), looked for up to ``wait``
    seconds; None if none shows."""
    deadline = time.monotonic() + wait
    while True:
        found = queued_as(name, logs_dir, exp, trial, known)
        if found:
            return found[-1]  # (the newest, should there be several)
        if time.monotonic() >= deadline:
            return None
        time.sleep(LOOK_EVERY)


def submit(path: str, what: str, name: str, logs_dir: str, exp: str, trial: str,
           known: Collection[str], unconfirmed: set[str]) -> str:
    """``sbatch`` the script at ``path`` (``what``: the job, for messages); its id. A job of
    ``name`` an earlier ``sbatch`` may have queued unseen (in ``unconfirmed``) is adopted
    instead, if queued; one this ``sbatch`` may have queued unseen is looked for
    (:data:`ADOPT_WAIT`), else ``name`` joins ``unconfirmed`` and SchedulerError says so."""
    if name in unconfirmed:
        found = queued_as(name, logs_dir, exp, trial, known)
        if found:
            unconfirmed.discard(name)
            log.warning("job %s (%s), queued by an sbatch that could not confirm it, is "
                        "taken as %s", found[-1], name, what)
            return found[-1]
    try:
        r = _run(["sbatch", "--parsable", path])
        why = "" if r.returncode == 0 or not unreachable(r) else last_error(r)
    except SchedulerError as e:  # (no answer within its time-out)
        why = str(e)
    if not why and r.returncode != 0:
        raise SchedulerError(f"sbatch refused the job of {what}: {last_error(r)} "
                             f"(script: {path})")
    if not why:
        unconfirmed.discard(name)
        return parse_sbatch_parsable(r.stdout)
    # a request sent that timed out may have been taken (one refused a connection was not)
    if any(word in why.lower() for word in ("timed out", "did not answer")):
        job_id = adopt(name, logs_dir, exp, trial, known, ADOPT_WAIT)
        if job_id is not None:
            unconfirmed.discard(name)
            log.warning("sbatch could not confirm the job of %s (%s), which Slurm queued all "
                        "the same as job %s: taken", what, why, job_id)
            return job_id
        unconfirmed.add(name)
    raise SchedulerError(f"sbatch could not reach Slurm's controller to submit {what}: {why} "
                         "(is slurmctld up, and this node's Slurm configuration readable? "
                         "`scontrol ping` tells; after a time-out, a job it queued all the "
                         "same is taken at the group's next submission)")
