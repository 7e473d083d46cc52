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

How long is left, and the pure parts: :mod:`scheduler.slurm_preempt`.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from scheduler.slurm_preempt import Preemption, look, seconds_left

log = logging.getLogger("controller")

POLL = 3.0
"""Seconds between two looks at the controller's own job (one ``scontrol`` each)."""

ASK_TIMEOUT = 3.0
"""Seconds one look waits for ``scontrol`` (no answer: no news, looked at again)."""

STARTED = time.time()
"""About when this process began (the launcher imports this module as it starts): where the
job's ``StartTime`` is unknown, a ``PreemptTime`` before it was another run's of the job."""


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
        return look(self.job_id, self.since, ASK_TIMEOUT)

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
            return seconds_left(job, self.found, time.time())
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
