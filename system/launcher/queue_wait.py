"""Registration that knows about the queue: a worker's register timeout starts when its job
starts running, pending jobs are shown with their reason, and a job the scheduler judged
blocked fails the trial at once with the scheduler's one line.

Pure bookkeeping over :class:`~scheduler.jobs.JobStatus` values; the clock is passed in.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

from scheduler.jobs import JobStatus
from system.errors import WorkerFailure


class StartClock:
    """When each worker's job was first seen out of the queue, and which jobs wait in it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.running_since: dict[str, float] = {}
        """Worker -> when its job was first seen not queued (running, or state unknown)."""
        self.waiting: dict[str, str] = {}
        """Job id -> ``"<kind> <reason>"`` of each job now waiting in the queue."""

    def update(self, statuses: Iterable[JobStatus], expected: set[str]) -> list[str]:
        """Note the jobs of ``expected`` workers; returns a line for each job newly pending or
        pending for a new reason (to print once)."""
        now, news, waiting = self.clock(), [], {}
        for st in statuses:
            mine = [w for w in st.workers if w in expected]
            if not mine:
                continue
            if st.queued:
                kind = mine[0].split("/")[0]
                waiting[st.job_id] = f"{kind} {st.reason or st.state.value.lower()}"
                if st.reason and self.waiting.get(st.job_id) != waiting[st.job_id]:
                    # (a job just submitted has no reason yet: said once it has one)
                    news.append(f"waiting in the queue: the {kind} group's job {st.job_id} "
                                f"is {st.state.value.lower()} (reason {st.reason})")
            else:
                for w in mine:
                    self.running_since.setdefault(w, now)
        self.waiting = waiting
        return news

    def pending_text(self) -> str:
        """``model Resources, generation Priority`` ('' when nothing waits)."""
        return ", ".join(self.waiting.values())

    def overdue(self, missing: Iterable[str], timeout: float) -> list[str]:
        """Those of ``missing`` whose job has run for more than ``timeout`` seconds."""
        now = self.clock()
        return sorted(w for w in missing
                      if w in self.running_since and now - self.running_since[w] > timeout)


def blocked_failure(statuses: Iterable[JobStatus]) -> WorkerFailure | None:
    """The first job the scheduler judged blocked, as a failure carrying its one line; not
    recovered (``config``): a new job would be blocked the same way (a partition or QOS it can
    never run in; past ``queue_timeout``: its clock would start again)."""
    for st in statuses:
        if st.blocked:
            worker = st.workers[0] if st.workers else None
            return WorkerFailure(st.blocked, worker, st.log_paths[0] if st.log_paths else None,
                                 config=True)
    return None
