"""Automatic recovery: which failures restart the workers that hold training state, how often,
and what each attempt cost.

A trial whose experiment declares *stateful* worker kinds (the RL experiments: the master and
the model workers) continues after one of those workers dies: the controller stops every worker
of those kinds, waits a back-off, starts them again, and they restore the latest checkpoint. The
stateless kinds (generation servers, rollout workers) stay up: their engines take about a
minute to start, and they receive the restored weights. Pure bookkeeping here; the controller
does the stopping and starting.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from system.errors import WorkerFailure
from system.launcher.config import RecoverConfig, RecoverMode


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

    @property
    def steps_lost(self) -> int | None:
        if self.failed_step is None:
            return None
        return max(0, self.failed_step - (self.resumed_from or 0))

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "steps_lost": self.steps_lost}


class Recovery:
    """Decides whether a failure is recovered, and records every attempt."""

    def __init__(self, cfg: RecoverConfig | None, stateful: tuple[str, ...], t0: float,
                 clock: Callable[[], float] = time.time, coupled: tuple[str, ...] = ()
                 ) -> None:
        self.cfg = cfg
        self.stateful = stateful
        self.coupled = coupled
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
        """A failure of a worker while retries are left (a failure naming no worker, such as
        ``controller.timeout``, is not recovered)."""
        if not self.enabled or failure.worker is None:
            return False
        assert self.cfg is not None
        return len(self.attempts) < self.cfg.retries

    def kinds_to_restart(self, failure: WorkerFailure, order: tuple[str, ...]
                         ) -> tuple[str, ...]:
        """Every stateful kind when a stateful worker failed (their state must come from one
        checkpoint), with the failed kind when it is coupled to them; else only the failed
        worker's own kind; and any kind whose restart a failure interrupted. In start
        ``order``."""
        kind = (failure.worker or "").split("/")[0]
        restart = {kind} | self.incomplete
        if kind in self.stateful or kind in self.coupled:
            restart |= set(self.stateful)
        return tuple(k for k in order if k in restart)

    def begin(self, failure: WorkerFailure, failed_step: int | None) -> Attempt:
        a = Attempt(attempt=len(self.attempts) + 1, cause=str(failure).splitlines()[0],
                    worker=failure.worker, failed_at_s=round(self._clock() - self.t0, 3),
                    failed_step=failed_step)
        self.attempts.append(a)
        return a

    def backoff(self) -> float:
        """Seconds to wait before the current attempt: ``recover.backoff``, doubled for each
        earlier attempt whose workers failed again within ``CRASH_LOOP_S`` of running (a crash
        loop); independent failures far apart each wait only the base back-off."""
        assert self.cfg is not None
        loops = 0
        for prev, cur in zip(reversed(self.attempts[:-1]), reversed(self.attempts)):
            if prev.recovered_at_s is None or cur.failed_at_s - prev.recovered_at_s > CRASH_LOOP_S:
                break
            loops += 1
        return self.cfg.backoff * 2 ** loops

    def running(self) -> None:
        """The restarted workers run again."""
        self.attempts[-1].recovered_at_s = round(self._clock() - self.t0, 3)

    def resumed(self, step: int) -> None:
        """The restarted master reported the step it continued from."""
        if self.attempts and self.attempts[-1].resumed_from is None:
            self.attempts[-1].resumed_from = step

    def summary(self) -> list[dict[str, Any]]:
        return [a.as_dict() for a in self.attempts]


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
