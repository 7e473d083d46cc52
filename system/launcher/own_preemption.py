"""A detached controller's own job chosen for preemption with a grace time.

A cluster that preempts with ``PreemptMode=REQUEUE`` (or ``CANCEL``) and a ``GraceTime``
sends SIGTERM to the tasks of a chosen job's steps at once, but to its batch shell only when
the grace ends, with ``KillWait`` seconds left before SIGKILL; the job's ``--signal`` is not
sent at all. The batch shell of a ``--detach`` controller is the controller itself: it would
learn of the preemption only then, without time for a checkpoint or even to stop every job
(those it leaves run on until their workers' ``orphan_timeout``). A controller that requeues
its own job (:func:`~system.launcher.self_requeue.requeues`) therefore looks at that job every
:data:`POLL` seconds. Once Slurm has chosen it (a ``PreemptTime`` since this run began), it
sends itself SIGUSR2, the time-limit warning, and takes that path within the grace left: a
checkpoint, every worker and job stopped, its own job requeued.

A partition that preempts by suspending (``PreemptMode=SUSPEND``) is left alone: its jobs
resume where they stopped.
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

from system.errors import SchedulerError

log = logging.getLogger("controller")

POLL = 3.0
"""Seconds between two looks at the controller's own job (one ``scontrol`` each)."""

ASK_TIMEOUT = 3.0
"""Seconds one look waits for ``scontrol`` (no answer: no news, looked at again)."""

STARTED = time.time()
"""About when this process began (the launcher imports this module as it starts): a
``PreemptTime`` before it was another run's of the same (requeued) job."""


@dataclasses.dataclass(frozen=True)
class Preemption:
    """Slurm chose the job for preemption at ``at`` (epoch seconds), with ``grace`` seconds to
    stop (its partition's ``GraceTime``; None when unknown)."""

    at: float
    grace: float | None

    def seconds_left(self, now: float) -> float | None:
        """Of the grace, at ``now`` (never below 0); None when the grace is unknown."""
        return None if self.grace is None else max(self.at + self.grace - now, 0.0)


def chosen_since(chosen_at: float | None, since: float) -> bool:
    """Whether a job's ``PreemptTime`` (parsed; None: never chosen) is at or after ``since``
    (pure; whole seconds, so one of slack): an earlier one was another run's."""
    return chosen_at is not None and chosen_at >= since - 1.0


def preemption(chosen_at: float, partition: dict[str, str]) -> Preemption | None:
    """The preemption of a job chosen at ``chosen_at`` in ``partition`` (``scontrol show
    partition``), unless that partition preempts by suspending (pure)."""
    if "SUSPEND" in partition.get("PreemptMode", "").upper():
        return None
    try:
        grace: float | None = float(partition["GraceTime"])
    except (KeyError, ValueError):
        grace = None
    return Preemption(chosen_at, grace)


def _warn_self() -> None:
    os.kill(os.getpid(), signal.SIGUSR2)


class PreemptionWatch:
    """Looks at Slurm job ``job_id`` (this controller's own) every ``poll`` seconds from a
    daemon thread; the first time it is found chosen for preemption since ``since``, prints
    it and calls ``notify`` (by default: SIGUSR2 to this process), then stops looking."""

    def __init__(self, job_id: str, since: float = STARTED,
                 notify: Callable[[], None] = _warn_self, poll: float = POLL) -> None:
        self.job_id, self.since, self.poll = job_id, since, poll
        self._notify = notify
        self._stop = threading.Event()
        self.found: Preemption | None = None

    def check(self) -> Preemption | None:
        """One look (two ``scontrol`` calls once chosen): the preemption, or None (none, or no
        answer)."""
        from scheduler.slurm_jobs import preempt_time, scontrol_job, scontrol_partition

        try:
            job = scontrol_job(self.job_id, ASK_TIMEOUT)
            chosen_at = preempt_time(job)
            if chosen_at is None or not chosen_since(chosen_at, self.since):
                return None
            partition = scontrol_partition(job.get("Partition", ""), ASK_TIMEOUT)
        except SchedulerError as e:
            log.warning("could not look at job %s: %s", self.job_id, e)
            return None
        return preemption(chosen_at, partition)

    def seconds_left(self) -> float | None:
        """Of the grace of the preemption found (None: none found, or its grace unknown)."""
        return None if self.found is None else self.found.seconds_left(time.time())

    def start(self) -> "PreemptionWatch":
        threading.Thread(target=self._run, name="own-preemption", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            found = self.check()
            if found is None:
                continue
            self.found = found
            left = self.seconds_left()
            grace = ("its grace unknown" if left is None
                     else f"{left:.0f}s of its {found.grace:.0f}s grace left")
            print(f"\nthe controller's job {self.job_id} was chosen for preemption ({grace}): "
                  "stopping the trial for a requeue", file=sys.stderr, flush=True)
            self._notify()
            return
