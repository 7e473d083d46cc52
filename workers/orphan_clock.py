"""When a worker judges its controller dead (pure: :class:`OrphanClock`; the worker reads the
key and stops, ``Worker._watch_controller``).

The controller keeps a liveness key with a TTL; a controller that died (kill -9, a lost login
node, a cancelled ``--detach`` job) must not leave its workers holding nodes and GPUs. A worker
judges it dead once the key has been gone for ``orphan_timeout`` seconds, or has not appeared
within that time of the worker's start (the controller writes it before it submits any job: one
that died while the job was queued). A name service that does not answer is no news at first:
once it answers again the clock restarts (it may have lost every key; the controller's returns
within its refresh). But it is no reprieve for ever: a live controller fails the trial once the
name service has been silent for its outage budget (``name_resolve.redis_outage_timeout``) and
stops its workers, so a worker that has not seen the key for ``orphan_timeout`` plus that budget
has lost its controller too (the login node that ran both the launcher and the Redis server went
down: the workers ran on until their time limit, every read failing)."""
from __future__ import annotations


class OrphanClock:
    """Feed it each read of the controller's key (:meth:`read`); it says when to stop."""

    def __init__(self, orphan_timeout: float, outage_budget: float, now: float) -> None:
        self.orphan_timeout = orphan_timeout
        self.outage_budget = outage_budget
        self.started = now
        self.seen: float | None = None
        """When the key was last seen."""
        self.unanswered: float | None = None
        """Since when the name service has not answered (None: it answers)."""

    def read(self, now: float, found: bool | None) -> str | None:
        """One read at ``now``: the key ``found``, not found (False) or the name service did not
        answer (None). Returns why the controller is judged dead, or None."""
        last = self.started if self.seen is None else self.seen
        if found is None:
            if self.unanswered is None:
                self.unanswered = now
            if now - last > self.orphan_timeout + self.outage_budget:
                return (f"the name service has not answered for {now - self.unanswered:.0f}s "
                        f"and the controller's liveness key was {self._last(now)} "
                        f"(orphan_timeout={self.orphan_timeout:.0f}s, plus "
                        f"{self.outage_budget:.0f}s for the name service to come back)")
            return None
        if self.unanswered is not None:  # back: it may have lost every key, the clock restarts
            self.unanswered = None
            self.started = now
            self.seen = None if self.seen is None else now
        if found:
            self.seen = now
            return None
        gone = now - (self.started if self.seen is None else self.seen)
        if gone <= self.orphan_timeout:
            return None
        how = ("has been gone for" if self.seen is not None else
               "has not appeared since this worker started,")
        return (f"the controller's liveness key {how} {gone:.0f}s "
                f"(orphan_timeout={self.orphan_timeout:.0f}s)")

    def _last(self, now: float) -> str:
        if self.seen is None:
            return f"not seen since this worker started, {now - self.started:.0f}s ago"
        return f"last seen {now - self.seen:.0f}s ago"
