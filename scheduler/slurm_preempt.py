"""How long Slurm leaves a job that it warned or chose for preemption (pure, but for one
``scontrol`` look).

A cluster that preempts with ``PreemptMode=REQUEUE`` (or ``CANCEL``) and a ``GraceTime`` sends
SIGTERM to the tasks of a chosen job's steps at once, not the job's ``--signal``; the job ends
when the grace does. A time limit's warning (``--signal=USR2@N``) comes N seconds (up to 60 more)
before the job's ``EndTime``. Both the detached controller
(:mod:`system.launcher.own_preemption`) and a warned worker (:mod:`workers.preempt_wait`) size
what they do before the end by :func:`seconds_left`.

How long is left: the partition's ``GraceTime`` from the ``PreemptTime`` (:data:`ASSUMED_GRACE`
where the partition gives none: a QOS's grace, say), or the job's ``EndTime`` if sooner; for
the time limit's warning, the ``EndTime``. A partition that preempts by suspending
(``PreemptMode=SUSPEND``) is left alone: its jobs resume where they stopped.
"""
from __future__ import annotations

import dataclasses

ASSUMED_GRACE = 30.0
"""Seconds of grace taken when the partition gives none (``GraceTime=0``, unknown): the grace
is then a QOS's, which ``scontrol`` does not show; a longer one only gives more than needed."""

@dataclasses.dataclass(frozen=True)
class Preemption:
    """Slurm chose the job for preemption at ``at`` and ends it at ``ends`` (epoch seconds);
    ``grace``: its partition's ``GraceTime`` (None: none given)."""

    at: float
    ends: float
    grace: float | None

    def seconds_left(self, now: float) -> float:
        """Before Slurm ends the job, at ``now`` (never below 0)."""
        return max(self.ends - now, 0.0)


def chosen_at(job: dict[str, float | None], since: float) -> float | None:
    """The ``PreemptTime`` of ``job`` (its time fields, parsed) if it is of the job's current
    run: at or after its ``StartTime`` (else ``since``; whole seconds, so one of slack) (pure).
    A requeued job's earlier run was chosen before it started again."""
    at, start = job.get("PreemptTime"), job.get("StartTime")
    return at if at is not None and at >= (since if start is None else start) - 1.0 else None


def preemption(job: dict[str, float | None], partition: dict[str, str],
               since: float) -> Preemption | None:
    """The preemption ``job`` (its time fields, parsed) is under, in ``partition`` (``scontrol
    show partition``); None when it is not chosen, or its partition suspends (pure)."""
    at = chosen_at(job, since)
    if at is None or "SUSPEND" in partition.get("PreemptMode", "").upper():
        return None
    try:
        grace: float | None = float(partition["GraceTime"]) or None
    except (KeyError, ValueError):
        grace = None
    ends = at + (grace or ASSUMED_GRACE)
    end = job.get("EndTime")
    return Preemption(at, min(ends, end) if end is not None and end >= at else ends, grace)


TIME_FIELDS = ("PreemptTime", "StartTime", "EndTime")


def look(job_id: str, since: float, timeout: float
         ) -> tuple[dict[str, float | None], Preemption | None]:
    """One look at Slurm job ``job_id`` (a second ``scontrol``, of its partition, once chosen):
    its time fields and the preemption it is under (None: none since ``since``, or its partition
    suspends). Raises what ``scontrol`` raises (SchedulerError: no answer within ``timeout``)."""
    from scheduler.slurm_jobs import job_time, scontrol_job, scontrol_partition

    raw = scontrol_job(job_id, timeout)
    job = {k: job_time(raw, k) for k in TIME_FIELDS}
    if chosen_at(job, since) is None:
        return job, None
    name = raw.get("Partition", "")
    partition = scontrol_partition(name, timeout) if name else {}
    return job, preemption(job, partition, since)


def seconds_left(job: dict[str, float | None], found: Preemption | None, now: float
                 ) -> float | None:
    """Before Slurm ends the job (its time fields, and the preemption :func:`look` found), at
    ``now``: of the preemption's grace, else up to its ``EndTime``; None when unknown (no time
    limit) (pure)."""
    if found is not None:
        return found.seconds_left(now)
    end = job.get("EndTime")
    return None if end is None else max(end - now, 0.0)
