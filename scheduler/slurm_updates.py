"""What a Slurm trial changes on its jobs once they are queued: the release of a requeued job
Slurm holds back, or of one it held after a failed launch, and ``Requeue=0`` on a job whose
worker was restarted elsewhere.

``Requeue=0`` matters beyond the moment: a job still requeued after one of its workers was
forgotten (:meth:`scheduler.slurm.SlurmScheduler.stop_worker`) starts that worker again beside
its replacement, and the stale copy registers over the live one's name. A Slurm controller that
could not be asked (not reached, or no answer in time: stalled, overloaded; the recovery that
forgot the worker went on) is asked again once it answers a poll
(:meth:`JobUpdates.after_answer`), until it answers or the job is no longer tracked. A
heterogeneous job is one job to Slurm: its leader is asked, and stays to be asked while any of
its components is tracked."""
from __future__ import annotations

import logging
import time
from typing import Collection

from scheduler.slurm_cli import UNREACHABLE
from scheduler.slurm_jobs import het_leader, scontrol_update, slurm_release

log = logging.getLogger("slurm")

RETRY_EVERY = 10.0
"""Seconds between the tries of an update Slurm could not be asked for (one ``scontrol``)."""

RETRY_TIMEOUT = 5.0
"""Seconds such a try, made within a poll, waits for Slurm's answer."""


class JobUpdates:
    """Updates of this trial's jobs, the ones Slurm did not take yet remembered and retried."""

    def __init__(self, requeue_release: float) -> None:
        self.requeue_release = requeue_release
        """See :attr:`scheduler.slurm_config.SlurmConfig.requeue_release` (0: never)."""
        self._release_at: dict[str, float] = {}  # held requeued job -> when to release it
        # job (leader) -> when Slurm was last asked for its Requeue=0 in vain (monotonic)
        self._requeue_left: dict[str, float] = {}

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
        """Make job ``job_id`` (a heterogeneous job's component: the whole job) never requeued;
        if Slurm could not be asked (not reached, no answer in time), said, and asked again
        after the polls Slurm answers; a refusal is said, and left (never raised)."""
        leader = het_leader(job_id)
        error = scontrol_update(leader, "Requeue=0", timeout)
        again = self._requeue_left.pop(leader, None) is not None
        if error is None:
            if again:
                log.warning("job %s will no longer be requeued: Slurm took Requeue=0 now",
                            leader)
        elif ended(error):  # (a job that ended cannot requeue)
            log.info("job %s ended before Requeue=0: %s", leader, error)
        elif not transient(error):
            log.warning("job %s may still be requeued (its restart would start a worker "
                        "restarted elsewhere again): Slurm refused Requeue=0: %s", leader, error)
        else:
            self._requeue_left[leader] = time.monotonic()
            if not again:  # (said once, not at each try)
                log.warning("job %s may still be requeued (its restart would start a worker "
                            "restarted elsewhere again): %s; asked again once Slurm answers",
                            leader, error)

    def after_answer(self, tracked: Collection[str]) -> None:
        """Slurm answered a poll of the ``tracked`` jobs: ask again for the updates it could
        not be asked before, each at most every :data:`RETRY_EVERY` seconds and given
        :data:`RETRY_TIMEOUT` (a poll is not held up long by a Slurm still slow: the first
        that goes unanswered ends the pass); a job no longer tracked (ended, cancelled, every
        component forgotten) needs none."""
        leaders = {het_leader(j) for j in tracked}
        for leader, tried in list(self._requeue_left.items()):
            if leader not in leaders:
                del self._requeue_left[leader]
            elif time.monotonic() - tried >= RETRY_EVERY:
                self.no_requeue(leader, RETRY_TIMEOUT)
                if leader in self._requeue_left:
                    return

    @property
    def unsettled(self) -> list[str]:
        """The jobs (leaders) whose ``Requeue=0`` is still to be asked for again."""
        return sorted(self._requeue_left)

    def forget(self, job_id: str) -> None:
        """Job ``job_id`` is no longer tracked: its release is no longer due (its
        ``Requeue=0`` goes once no component of its job is tracked: :meth:`after_answer`)."""
        self._release_at.pop(job_id, None)


def ended(error: str) -> bool:
    """Whether a Slurm command's ``error`` says the job has ended (or is no job any more)."""
    text = error.lower()
    return any(s in text for s in ("already completing or completed", "invalid job id",
                                   "has already finished"))


def transient(error: str) -> bool:
    """Whether a Slurm command's ``error`` says it could not reach Slurm's controller, or had
    no answer in time (it may take the request later, or never got it): asked again."""
    text = error.lower()
    return "did not answer" in text or any(s in text for s in UNREACHABLE + (
        "unexpected message received",))  # (a late answer to a request that timed out)
