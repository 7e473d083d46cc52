"""What a Slurm trial changes on its jobs once they are queued: the release of a requeued job
Slurm holds back, or of one it held after a failed launch, and ``Requeue=0`` on a job whose
worker was restarted elsewhere.

``Requeue=0`` matters beyond the moment: a job still requeued after one of its workers was
forgotten (:meth:`scheduler.slurm.SlurmScheduler.stop_worker`) starts that worker again beside
its replacement, and the stale copy registers over the live one's name. A Slurm controller that
did not answer the update (stalled, overloaded: the recovery that forgot the worker went on)
is asked again once it answers a poll (:meth:`JobUpdates.after_answer`), until it takes it or
the job is no longer tracked."""
from __future__ import annotations

import logging
import time
from typing import Collection

from scheduler.slurm_jobs import scontrol_update, slurm_release

log = logging.getLogger("slurm")

RETRY_EVERY = 10.0
"""Seconds between the tries of an update Slurm has not taken (each is one ``scontrol``)."""


class JobUpdates:
    """Updates of this trial's jobs, the ones Slurm did not take yet remembered and retried."""

    def __init__(self, requeue_release: float) -> None:
        self.requeue_release = requeue_release
        """See :attr:`scheduler.slurm_config.SlurmConfig.requeue_release` (0: never)."""
        self._release_at: dict[str, float] = {}  # held requeued job -> when to release it
        self.requeue_left: dict[str, float] = {}
        """Job -> when ``Requeue=0`` was last tried (monotonic), for jobs Slurm did not take
        it for yet."""

    def release_when_due(self, job_id: str, timeout: float) -> None:
        """A requeued job held back by Slurm: make it eligible ``requeue_release`` seconds after
        the hold was first seen (see :attr:`SlurmConfig.requeue_release`)."""
        if not self.requeue_release:
            return
        now = time.monotonic()
        due = self._release_at.setdefault(job_id, now + self.requeue_release)
        if now < due:
            return
        del self._release_at[job_id]
        error = scontrol_update(job_id, "StartTime=now", timeout)
        if error is None:
            log.info("requeued job %s made eligible again (Slurm's hold released)", job_id)
        else:
            log.warning("could not release requeued job %s: %s", job_id, error)

    @staticmethod
    def release_held(job_id: str, timeout: float) -> None:
        """A job Slurm held after its launch failed (its node went down as it started, say:
        ``launch failed requeued held``, priority 0) would pend for good: release it, once per
        hold, so it starts again wherever it fits (the trial rejoins it as after a requeue)."""
        error = slurm_release(job_id, timeout)
        if error is None:
            log.warning("job %s was held by Slurm after its launch failed: released", job_id)
        else:
            log.warning("could not release held job %s: %s", job_id, error)

    def no_requeue(self, job_id: str, timeout: float) -> None:
        """Make job ``job_id`` never requeued; if Slurm does not take it, said, and asked
        again after the polls Slurm answers (never raised)."""
        error = scontrol_update(job_id, "Requeue=0", timeout)
        if error is None:
            self.requeue_left.pop(job_id, None)
            return
        self.requeue_left[job_id] = time.monotonic()
        log.warning("job %s may still be requeued (its restart would start a worker restarted "
                    "elsewhere again): %s; asked again once Slurm answers", job_id, error)

    def after_answer(self, tracked: Collection[str], timeout: float) -> None:
        """Slurm answered a poll of the ``tracked`` jobs: ask again for the updates it did not
        take (each at most every :data:`RETRY_EVERY` seconds); a job no longer tracked (ended,
        cancelled) needs none."""
        for job_id, tried in list(self.requeue_left.items()):
            if job_id not in tracked:
                del self.requeue_left[job_id]
            elif time.monotonic() - tried >= RETRY_EVERY:
                error = scontrol_update(job_id, "Requeue=0", timeout)
                if error is None:
                    del self.requeue_left[job_id]
                    log.warning("job %s will no longer be requeued: Slurm took Requeue=0 now",
                                job_id)
                else:
                    self.requeue_left[job_id] = time.monotonic()

    def forget(self, job_id: str) -> None:
        self._release_at.pop(job_id, None)
        self.requeue_left.pop(job_id, None)
