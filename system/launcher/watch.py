"""What the controller reads from name resolution while it watches a trial.

Each poll reads three things: the workers' error reports, the addresses they are registered at
(a restarted worker registers anew) and which of them still heart-beat. :class:`NameWatch`
holds that reading apart from the controller, so that it can be measured over many simulated
workers (``tests/benchmarks/scale.py``) without a whole trial.

It reads only what can have changed, so that a poll every 0.2 s stays cheap with a thousand
workers on a shared filesystem:

- a heartbeat is read again only once the expiry it had when last read has passed (a live worker
  refreshed it meanwhile: its keep-alive rewrites it every ``ttl/3``), so a worker that went
  silent is seen at the poll after its heartbeat expired, and each heartbeat is read about once
  per ``2/3 ttl`` instead of at every poll; a deleted heartbeat is seen within ``recheck``
  seconds (the controller passes the heartbeat TTL);
- addresses are read for the workers rejoining at every poll, for all workers every
  ``recheck / 2`` seconds (a worker restarted at a new address without the scheduler noticing);
- no directory walk or key scan but the errors' (a directory that rarely exists) and the
  listing of registered workers, which is paced by its own cost
  (:meth:`NameWatch.registration_interval`).

A liveness read from a restarted worker's previous incarnation is at most ``recheck`` old: the
restarted worker is then judged by its own heartbeat.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Collection, Iterable

from scheduler.jobs import JobState, JobStatus
from system import names
from system.errors import ConfigError
from system.name_resolve import NameResolve


@dataclasses.dataclass(frozen=True)
class WatchView:
    """One poll's reading: ``errors`` ``{key: report}``, ``addresses`` ``{worker: address}``
    (of the workers read this time), ``beating`` the workers whose heartbeat is alive."""

    errors: dict[str, str]
    addresses: dict[str, str]
    beating: frozenset[str]


class NameWatch:
    """Reads a trial's errors, addresses and heartbeats; workers are named ``kind/index``.
    ``recheck``: the longest a heartbeat's liveness is taken from an earlier read (seconds)."""

    def __init__(self, nr: NameResolve, exp: str, trial: str, recheck: float,
                 clock: Callable[[], float] = time.time) -> None:
        if recheck <= 0:
            raise ConfigError(f"recheck must be > 0 seconds, got {recheck}")
        self.nr = nr
        self.recheck = recheck
        self._clock = clock  # wall clock: expiries are unix times
        self._exp, self._trial = exp, trial
        self._errors = names.worker_errors(exp, trial)
        self._addresses = names.worker_addresses(exp, trial)
        self._live_until: dict[str, float] = {}  # worker -> when its liveness must be read again
        self._addresses_read = float("-inf")
        self._listing_s = 0.0  # how long the last listing of registered workers took

    def errors(self) -> dict[str, str]:
        """``{key: report}`` of every error a worker published."""
        return self.nr.get_subtree(self._errors)

    def registered(self) -> dict[str, str]:
        """``{worker: address}`` of every registered worker (one listing)."""
        t0 = time.monotonic()
        n = len(self._addresses) + 1
        found = {k[n:]: v for k, v in self.nr.get_subtree(self._addresses).items()}
        self._listing_s = time.monotonic() - t0
        return found

    def registration_interval(self, minimum: float, maximum: float = 1.0) -> float:
        """Seconds to wait before :meth:`registered` lists again: ``minimum``, or longer so that
        listing takes at most a tenth of the time (a thousand workers on a shared filesystem
        take tens of milliseconds to list; the wait for queued jobs can last hours), but at
        most ``maximum`` (a listing slowed down by a busy machine must not delay the start)."""
        return min(max(minimum, 9 * self._listing_s), max(minimum, maximum))

    def addresses(self, workers: Collection[str], rejoining: Collection[str] = ()
                  ) -> dict[str, str]:
        """``{worker: address}`` of the registered ones among ``rejoining``, and among all of
        ``workers`` every ``recheck / 2`` seconds."""
        now = self._clock()
        if now - self._addresses_read >= self.recheck / 2:
            self._addresses_read = now
            wanted = list(workers)
        else:
            wanted = [w for w in rejoining if w in workers]
        keys = {self._key(names.worker_address, w): w for w in wanted}
        return {keys[k]: e.value for k, e in self.nr.read_many(list(keys)).items()}

    def beating(self, workers: Collection[str]) -> frozenset[str]:
        """Those of ``workers`` whose heartbeat is alive."""
        now = self._clock()
        due = {self._key(names.heartbeat, w): w for w in workers
               if self._live_until.get(w, now) <= now}
        if due:
            read = self.nr.read_many(list(due))
            for key, w in due.items():
                entry = read.get(key)
                if entry is None:
                    self._live_until.pop(w, None)
                else:
                    until = now + self.recheck
                    self._live_until[w] = until if entry.expires is None else min(
                        entry.expires, until)
        return frozenset(w for w in workers if self._live_until.get(w, now) > now)

    def alive(self, workers: Collection[str]) -> dict[str, str]:
        """``{worker: "host:pid:nonce"}`` of those of ``workers`` whose witness vouches for their
        process (:mod:`system.launcher.witness`), read now: asked of silent workers only."""
        keys = {self._key(names.alive, w): w for w in workers}
        return {keys[k]: e.value for k, e in self.nr.read_many(list(keys)).items()} if keys else {}

    def poll(self, workers: Collection[str], rejoining: Collection[str] = ()) -> WatchView:
        """Everything one iteration of the controller's watch loop reads, in its order."""
        return WatchView(self.errors(), self.addresses(workers, rejoining),
                         self.beating(workers))

    def _key(self, make: Callable[[str, str, str, int], str], worker: str) -> str:
        kind, index = worker.split("/")
        return make(self._exp, self._trial, kind, int(index))


def vouched(statuses: Iterable[JobStatus]) -> frozenset[str]:
    """The workers whose own process the scheduler sees running: each running job of one
    worker (a local process; a Slurm job of one task). A job of several workers runs while any
    of them does: it vouches for none (see :func:`shared`)."""
    return frozenset(st.workers[0] for st in statuses
                     if st.state == JobState.RUNNING and len(st.workers) == 1)


def shared(statuses: Iterable[JobStatus]) -> frozenset[str]:
    """The workers of running jobs of several workers: the scheduler vouches for none of them;
    their witnesses may (:meth:`NameWatch.alive`)."""
    return frozenset(w for st in statuses if st.state == JobState.RUNNING and len(st.workers) > 1
                     for w in st.workers)


class LateBeats:
    """Judges silent workers (heartbeat expired): one whose process is not known to run is
    dead at once; one whose process runs is *late* first, and dead once it has stayed silent
    for ``grace`` seconds more (hung). Pure but for the clock (monotonic seconds)."""

    def __init__(self, grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        if grace < 0:
            raise ConfigError(f"grace must be >= 0 seconds, got {grace}")
        self.grace = grace
        self._clock = clock
        self._since: dict[str, float] = {}  # late worker -> when it was first seen silent

    def judge(self, silent: Collection[str], running: Collection[str]
              ) -> tuple[list[str], list[str]]:
        """``(dead, newly_late)`` among ``silent``, given the workers whose process
        ``running``; a worker no longer silent (it beats again, or was restarted) is
        forgotten."""
        now = self._clock()
        self._since = {w: t for w, t in self._since.items() if w in silent and w in running}
        dead, late = [], []
        for w in sorted(silent):
            if w not in running or not self.grace:
                dead.append(w)
            elif w not in self._since:
                self._since[w] = now
                late.append(w)
            elif now - self._since[w] > self.grace:
                dead.append(w)
        return dead, late

    def describe(self, ttl: float) -> str:
        """What a newly late worker's line says."""
        return (f"no heartbeat within {ttl:.1f}s, but its process runs (a busy machine, or "
                f"hung): judged hung if still silent in {self.grace:.0f}s")
