"""The requeue/rejoin policy: which workers are rejoining the trial after their job was requeued.

Pure bookkeeping over the :class:`~scheduler.jobs.JobStatus` values a scheduler reports: restart
counts per job, a deadline per rejoining worker, the incarnation (restart count) each worker was
configured at. Polling is passed in (``poll``: a fresh look at every job), as are the clock and
``sleep``, so the policy runs against fake statuses in tests. :class:`RequeuePolicy` with
``requeue=False`` never waits for a requeue (the local scheduler's); the Slurm scheduler builds
one from its ``SlurmConfig``.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

from scheduler.jobs import JobStatus

Poll = Callable[[], list[JobStatus]]
"""A fresh look at every job of the trial."""

SETTLE_SECONDS = 5.0
"""How long a job that looks ended is asked again before it is judged (requeue on)."""
RETRY_SECONDS = 0.5


@dataclasses.dataclass(frozen=True)
class Restart:
    """A job seen requeued: ``job`` (its status at that restart) and its workers that must
    rejoin (not those already configured in the new incarnation)."""

    job: JobStatus
    rejoining: tuple[str, ...]


class RequeuePolicy:
    """Restart counts, rejoin deadlines and incarnations of one trial's workers."""

    def __init__(self, requeue: bool = False, rejoin_timeout: float = 0.0,
                 requeue_grace: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.requeue = requeue
        """Jobs may be requeued: a job that looks ended, or a worker that failed a start-up
        call, is given time to show a requeue before it is judged."""
        self.rejoin_timeout = rejoin_timeout
        """Seconds a requeued worker has to register again."""
        self.requeue_grace = requeue_grace
        """Seconds a worker that failed a start-up call has for its job to show a requeue."""
        self.restarts: dict[str, int] = {}
        """Job id -> the restart count last seen (only jobs that restarted)."""
        self.rejoining: dict[str, float] = {}
        """Worker -> the (clock) deadline by which it must register again."""
        self.incarnation: dict[str, int] = {}
        """Worker -> the restart count it was configured at."""
        self._clock, self._sleep = clock, sleep

    def settle(self, statuses: list[JobStatus], poll: Poll) -> list[JobStatus]:
        """A requeued Slurm job can briefly show an ended state (its batch script is killed by
        the requeue) before it is pending again: with requeue on, give a job that looks ended a
        few seconds and ask again before judging it."""
        if not self.requeue:
            return statuses
        deadline = self._clock() + SETTLE_SECONDS
        while any(not s.state.active for s in statuses) and self._clock() < deadline:
            self._sleep(RETRY_SECONDS)
            statuses = poll()
        return statuses

    def note(self, statuses: Iterable[JobStatus]) -> list[Restart]:
        """Record every job whose restart count grew: its workers are rejoining (they will
        register again, at new addresses), but those already configured in that incarnation."""
        found = []
        for st in statuses:
            if st.restarts > self.restarts.get(st.job_id, 0):
                self.restarts[st.job_id] = st.restarts
                deadline = self._clock() + self.rejoin_timeout
                rejoining = []
                for w in st.workers:
                    if self.incarnation.get(w, -1) >= st.restarts:
                        continue  # already configured in its new incarnation (start-up)
                    self.rejoining[w] = deadline
                    rejoining.append(w)
                found.append(Restart(st, tuple(rejoining)))
        return found

    def moved(self, workers: Iterable[str]) -> None:
        """``workers`` registered at new addresses (restarted, whether or not a poll caught
        their job requeued): they are rejoining, with a fresh deadline unless they already were."""
        deadline = self._clock() + self.rejoin_timeout
        for w in workers:
            self.rejoining.setdefault(w, deadline)

    def respawned(self, workers: Iterable[str], timeout: float) -> None:
        """``workers`` were started again by the controller (a recovery restarts a dead
        stateless worker alone): they are rejoining, and must register within ``timeout``."""
        deadline = self._clock() + timeout
        for w in workers:
            self.rejoining[w] = deadline

    def queued(self, workers: Iterable[str]) -> None:
        """``workers``' jobs wait in the queue (requeued, pending for resources, a partition
        down): their time to rejoin counts from when the job runs, as at start-up (a requeued
        job that waited past ``rejoin_timeout`` failed its worker, the wait named nowhere)."""
        deadline = self._clock() + self.rejoin_timeout
        for w in workers:
            if w in self.rejoining:
                self.rejoining[w] = max(self.rejoining[w], deadline)

    def overdue(self, back: Iterable[str]) -> list[str]:
        """Rejoining workers, but those in ``back``, whose deadline has passed."""
        back = set(back)
        now = self._clock()
        return [w for w, deadline in self.rejoining.items() if w not in back and now > deadline]

    def rejoined(self, workers: Iterable[str]) -> None:
        for w in workers:
            del self.rejoining[w]

    def configured(self, worker: str, restart: int) -> None:
        """``worker`` answered ``configure`` from incarnation ``restart``."""
        self.incarnation[worker] = restart

    def wait_requeued(self, worker: str, poll: Poll,
                      on_restarts: Callable[[list[Restart]], None]) -> bool:
        """Whether ``worker``'s job was requeued, polling for up to ``requeue_grace`` seconds
        (Slurm's batch script requeues once srun has returned, after every task's graceful
        stop); every restart noted meanwhile goes to ``on_restarts``."""
        if not self.requeue:
            return False
        deadline = self._clock() + self.requeue_grace
        while True:
            on_restarts(self.note(poll()))
            if worker in self.rejoining:
                return True
            if self._clock() > deadline:
                return False
            self._sleep(RETRY_SECONDS)
