"""Automatic recovery: what a failure restarts, how often, and what each attempt cost.

A trial whose experiment declares *stateful* worker kinds (the RL experiments: the master and
the model workers) continues after one of those workers dies: the controller stops every worker
of those kinds, waits a back-off, starts them again, and they restore the latest checkpoint. The
stateless kinds (generation servers, rollout workers) stay up: their engines take about a
minute to start, and they receive the restored weights. A stateless worker that dies is
restarted alone, at once, while training goes on; it rejoins like a requeued worker. Pure
bookkeeping here; the controller does the stopping and starting.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from system.errors import WorkerFailure, first_line
from system.launcher.config import RecoverConfig, RecoverMode


class Requeued(WorkerFailure):
    """The scheduler requeued the job of a worker that holds training state (preempted, or at
    its time limit): it is recovered like a failure (the stateful workers restart from the
    checkpoint the preempted ones asked for), but it is not one: it draws on no
    ``recover.retries``, however often it happens."""


class Paused(Requeued):
    """The controller itself was stopped (SIGSTOP, a suspended machine) for longer than
    ``controller.orphan_timeout``: every worker has stopped itself as an orphan, or is about to.
    Every worker restarts from the latest checkpoint; not a failure of theirs either."""


CRASH_LOOP_S = 60.0
"""A failure this soon after the previous recovery counts as the same crash loop."""


@dataclasses.dataclass
class Attempt:
    """One automatic recovery."""

    attempt: int
    """1 for the first recovery."""
    cause: str
    """The failure that triggered it (its first line)."""
    worker: str | None
    failed_at_s: float
    """Seconds since the trial began."""
    failed_step: int | None
    """The last step the master reported before the failure."""
    resumed_from: int | None = None
    """The step the restarted master continued from (None: from the start)."""
    recovered_at_s: float | None = None
    """Seconds since the trial began when the restarted workers were running again."""
    restarted: list[str] = dataclasses.field(default_factory=list)
    """The workers started again: every worker of the kinds a stateful recovery restarted, or
    the one stateless worker restarted alone."""
    stateful: bool = True
    """Whether the workers that hold training state restarted from a checkpoint (else only
    the failed stateless worker restarted, and training went on)."""
    also: list[str] = dataclasses.field(default_factory=list)
    """Workers that failed as the failure's consequence (a peer of the dead one raised)."""
    requeued: bool = False
    """It followed a requeue (:class:`Requeued`), not a failure: no retry was drawn on."""
    paused: bool = False
    """It followed a pause of the controller (:class:`Paused`), not a failure: no retry was
    drawn on."""

    @property
    def free(self) -> bool:
        """It drew on no ``recover.retries`` (a requeue or a pause)."""
        return self.requeued or self.paused

    @property
    def steps_lost(self) -> int | None:
        if not self.stateful:
            return 0
        if self.failed_step is None:
            return None
        return max(0, self.failed_step - (self.resumed_from or 0))

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "steps_lost": self.steps_lost}


class Recovery:
    """Decides whether a failure is recovered, and records every attempt."""

    def __init__(self, cfg: RecoverConfig | None, stateful: tuple[str, ...], t0: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg = cfg
        self.stateful = stateful
        self.incomplete: set[str] = set()
        """Kinds whose restart began but did not finish (a failure came meanwhile)."""
        self.t0 = t0
        self.attempts: list[Attempt] = []
        self._clock = clock

    @property
    def enabled(self) -> bool:
        return (self.cfg is not None and self.cfg.type == RecoverMode.AUTO
                and bool(self.stateful))

    def should_recover(self, failure: WorkerFailure) -> bool:
        """A failure of a worker while retries are left: ``recover.retries`` restarts of the
        stateful workers, and as many of each stateless worker (a failure naming no worker,
        such as ``controller.timeout``, or a worker's configuration error is not recovered)."""
        if not self.enabled or failure.worker is None or failure.config:
            return False
        return isinstance(failure, Requeued) or self._retries_left(failure)

    def _retries_left(self, failure: WorkerFailure) -> bool:
        assert self.cfg is not None
        if self.restarts_stateful(failure):
            return sum(a.stateful and not a.free for a in self.attempts) < self.cfg.retries
        return sum(not a.stateful and failure.worker in a.restarted
                   for a in self.attempts) < self.cfg.retries

    def unrecovered(self, failure: WorkerFailure) -> WorkerFailure:
        """``failure``, which :meth:`should_recover` refused, saying so when that was for want
        of retries (else as it is)."""
        if not self.enabled or failure.worker is None or failure.config:
            return failure
        assert self.cfg is not None
        what = ", ".join(self.stateful) if self.restarts_stateful(failure) else failure.worker
        what = f"restarts of {what}"
        return WorkerFailure(f"{failure}\nnot recovered: recover.retries={self.cfg.retries} "
                             f"{what} are used up", failure.worker, failure.log_path,
                             also=failure.also)

    def restarts_stateful(self, failure: WorkerFailure) -> bool:
        """Whether ``failure`` restarts the stateful workers: one of them failed (or failed as
        its consequence), or their restart was interrupted."""
        return bool(set(_kinds(failure)) & set(self.stateful)) or bool(self.incomplete)

    def kinds_to_restart(self, failure: WorkerFailure, order: tuple[str, ...]
                         ) -> tuple[str, ...]:
        """Every stateful kind and any kind whose restart a failure interrupted, in start
        ``order`` (when :meth:`restarts_stateful`). A stateless worker named as the cause of a
        stateful one's failure (``also``) is not among them: its whole kind would restart (each
        server's engine takes a minute); its ended job is respawned alone afterwards."""
        restart = self.incomplete | set(self.stateful)
        if not failure.also:  # (a stateless worker whose death made a stateful one raise is
            restart |= set(_kinds(failure))  # respawned alone once its ended job is seen)
        return tuple(k for k in order if k in restart)

    def begin(self, failure: WorkerFailure, failed_step: int | None,
              restarted: list[str] | None = None) -> Attempt:
        """Record a recovery; ``restarted``: the one stateless worker restarted alone (None:
        the stateful workers restart)."""
        a = Attempt(attempt=len(self.attempts) + 1, cause=first_line(failure),
                    worker=failure.worker, failed_at_s=round(self._clock() - self.t0, 3),
                    failed_step=failed_step, restarted=list(restarted or []),
                    stateful=restarted is None, also=list(failure.also),
                    requeued=isinstance(failure, Requeued) and not isinstance(failure, Paused),
                    paused=isinstance(failure, Paused))
        self.attempts.append(a)
        return a

    def count(self, attempt: Attempt) -> int:
        """``attempt``'s number among those that draw on the same ``recover.retries``: the
        restarts of the stateful workers after a failure, or of that one stateless worker (not
        for a requeue, which draws on none)."""
        same = [a for a in self.attempts if (a.stateful and not a.free if attempt.stateful
                                             else not a.stateful
                                             and a.restarted == attempt.restarted)]
        return same.index(attempt) + 1

    def backoff(self) -> float:
        """Seconds to wait before the current attempt: none after an independent failure (the
        restart starts at once), ``recover.backoff`` when the previous attempt's workers failed
        again within ``CRASH_LOOP_S`` of running without getting past the step that failed
        before (a crash loop), doubled for each such attempt before it. (A failure after the
        trial went on past the last one is a new fault, not the same one again.)"""
        assert self.cfg is not None
        if self.attempts and self.attempts[-1].free:
            return 0.0  # a preemption: no crash loop, and the new jobs queue anyway
        loops = 0
        restarts = [a for a in self.attempts if a.stateful and not a.free]
        for prev, cur in zip(reversed(restarts[:-1]), reversed(restarts)):
            if prev.recovered_at_s is None or cur.failed_at_s - prev.recovered_at_s > CRASH_LOOP_S:
                break
            if None not in (prev.failed_step, cur.failed_step) and \
                    cur.failed_step > prev.failed_step:  # type: ignore[operator]
                break  # it made progress past the last failure
            loops += 1
        return self.cfg.backoff * 2 ** (loops - 1) if loops else 0.0

    def running(self, workers: list[str] | None = None) -> None:
        """The restarted stateful workers run again (the latest stateful attempt is recovered),
        or the respawned ``workers`` do: each one recovers the latest attempt that restarted it
        alone (two respawned in separate attempts can rejoin at one poll)."""
        now = round(self._clock() - self.t0, 3)
        left = set(workers or ())
        for a in reversed(self.attempts):
            if workers is None:
                if a.recovered_at_s is None and a.stateful:
                    a.recovered_at_s = now
                    return
                continue
            if not left:
                return
            if set(a.restarted) & left:
                if not a.stateful and a.recovered_at_s is None:
                    a.recovered_at_s = now
                # its latest restart is this one: an earlier attempt for it was not recovered
                left -= set(a.restarted)

    def resumed(self, step: int) -> None:
        """The restarted master reported the step it continued from."""
        for a in reversed(self.attempts):
            if a.stateful:
                if a.resumed_from is None:
                    a.resumed_from = step
                return

    def summary(self) -> list[dict[str, Any]]:
        return [a.as_dict() for a in self.attempts]


def _kinds(failure: WorkerFailure) -> list[str]:
    """The kinds of the failed worker and of those that failed as its consequence."""
    return [w.split("/")[0] for w in (failure.worker or "", *failure.also) if w]


@dataclasses.dataclass
class MasterProgress:
    """What the controller learned from the master's progress (its ``ping``)."""

    progress: dict[str, Any] = dataclasses.field(default_factory=dict)
    changed_at: float = dataclasses.field(default_factory=time.monotonic)
    last_step: int | None = None
    resumed_from: int | None = None

    def update(self, progress: dict[str, Any]) -> None:
        if progress != self.progress:
            self.progress, self.changed_at = dict(progress), time.monotonic()
        step = progress.get("step")
        if isinstance(step, str) and step.split("/")[0].isdigit():
            self.last_step = int(step.split("/")[0])
        if isinstance(progress.get("resumed_from"), int):
            self.resumed_from = int(progress["resumed_from"])

    def unchanged_for(self) -> float:
        return time.monotonic() - self.changed_at

    def restarted(self) -> None:
        self.progress, self.changed_at, self.resumed_from = {}, time.monotonic(), None
