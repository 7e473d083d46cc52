"""A detached controller's own job chosen for preemption with a grace time.

A cluster that preempts with ``PreemptMode=REQUEUE`` (or ``CANCEL``) and a ``GraceTime``
sends SIGTERM to the tasks of a chosen job's steps at once, but to its batch shell only when
the grace ends, with ``KillWait`` seconds left before SIGKILL; the job's ``--signal`` is not
sent at all. The batch shell of a ``--detach`` controller is the controller itself: it would
learn of the preemption only then, without time for a checkpoint or even to stop every job
(those it leaves run on until their workers' ``orphan_timeout``). A controller that requeues
its own job (:func:`~system.launcher.self_requeue.requeues`) therefore looks at that job every
:data:`POLL` seconds. Once Slurm has chosen it (a ``PreemptTime`` since the job's current run
began), it sends itself SIGUSR2, the time-limit warning, and takes that path within the grace
left: a checkpoint, every worker and job stopped, its own job requeued.

How long is left: the partition's ``GraceTime`` from the ``PreemptTime`` (:data:`ASSUMED_GRACE`
where the partition gives none: a QOS's grace, say), or the job's ``EndTime`` if sooner; for
the time limit's warning, the ``EndTime``. A partition that preempts by suspending
(``PreemptMode=SUSPEND``) is left alone: its jobs resume where they stopped.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

log = logging.getLogger("controller")

POLL = 3.0
"""Seconds between two looks at the controller's own job (one ``scontrol`` each)."""

ASK_TIMEOUT = 3.0
"""Seconds one look waits for ``scontrol`` (no answer: no news, looked at again)."""

ASSUMED_GRACE = 30.0
"""Seconds of grace taken when the partition gives none (``GraceTime=0``, unknown): the grace
is then a QOS's, which ``scontrol`` does not show; a longer one only gives more than needed."""

STARTED = time.time()
"""About when this process began (the launcher imports this module as it starts): where the
job's ``StartTime`` is unknown, a ``PreemptTime`` before it was another run's of the job."""


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


def _warn_self() -> None:
    os.kill(os.getpid(), signal.SIGUSR2)


class PreemptionWatch:
    """Looks at Slurm job ``job_id`` (this controller's own) every ``poll`` seconds from a
    daemon thread; the first time it is found chosen for preemption, prints it and calls
    ``notify`` (by default: SIGUSR2 to this process), then stops looking."""

    def __init__(self, job_id: str, since: float = STARTED,
                 notify: Callable[[], None] = _warn_self, poll: float = POLL) -> None:
        self.job_id, self.since, self.poll = job_id, since, poll
        self._notify = notify
        self._stop = threading.Event()
        self._failed = 0
        self.found: Preemption | None = None

    def look(self) -> tuple[dict[str, float | None], Preemption | None]:
        """One look (a second ``scontrol`` once chosen): the job's time fields and its
        preemption. Raises what ``scontrol`` raises (SchedulerError: no answer)."""
        from scheduler.slurm_jobs import job_time, scontrol_job, scontrol_partition

        raw = scontrol_job(self.job_id, ASK_TIMEOUT)
        job = {k: job_time(raw, k) for k in TIME_FIELDS}
        if chosen_at(job, self.since) is None:
            return job, None
        name = raw.get("Partition", "")
        partition = scontrol_partition(name, ASK_TIMEOUT) if name else {}
        return job, preemption(job, partition, self.since)

    def seconds_left(self) -> float | None:
        """Before Slurm ends the job: of the preemption's grace, or (none found yet: a fresh
        look) up to its ``EndTime``; None when unknown. Asked by the controller as it stops
        (the time limit's warning, or a preemption's)."""
        if self.found is None:
            try:
                job, self.found = self.look()
            except Exception as e:  # noqa: BLE001 - unknown: the caller takes signal_seconds
                log.warning("could not look at job %s: %s", self.job_id, e)
                return None
            end = job.get("EndTime")
            if self.found is None:
                return None if end is None else max(end - time.time(), 0.0)
        return self.found.seconds_left(time.time())

    def start(self) -> "PreemptionWatch":
        threading.Thread(target=self._run, name="own-preemption", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                _, found = self.look()
            except Exception as e:  # noqa: BLE001 - a busy slurmctld: look again
                self._failed += 1
                if self._failed in (1, 10) or self._failed % 100 == 0:  # not every 3 s
                    log.warning("could not look at job %s (%d times): %s", self.job_id,
                                self._failed, e)
                continue
            if found is None or self._stop.is_set():
                continue
            self.found = found
            grace = "none given" if found.grace is None else f"{found.grace:.0f}s"
            print(f"\nthe controller's job {self.job_id} was chosen for preemption "
                  f"({found.seconds_left(time.time()):.0f}s left; grace: {grace}): stopping "
                  "the trial for a requeue", file=sys.stderr, flush=True)
            self._notify()
            return
