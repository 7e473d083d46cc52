"""How a generation engine's loop fails, and the clock that judges its engine core hung.

vLLM notices an engine core that died (its monitor sets ``engine_dead``), not one that lives
but never answers: stopped (SIGSTOP, a frozen container), deadlocked, stuck in a device call.
Its client then waits for the step's outputs forever, and the server would heart-beat on with
an engine that answers nothing. :class:`StepClock` times each step; the engine's watch asks it
whether the step in progress has run past ``rl.vllm.step_timeout``. Pure but for the clock.

An engine's first step also warms it up (kernels compiled or tuned on first use, its first
forward): 1.7 s for arith-tiny's inline engine on this 2-core machine against 10-20 ms for the
steps after it, and 6.1 s with its own processes, so a run with a step_timeout of 5 s judged a
healthy server hung at each start. That step is given at least :data:`FIRST_STEP_LIMIT`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["EngineHung", "GenerationLoopDied", "StepClock"]


class GenerationLoopDied(RuntimeError):
    """The engine's loop thread raised: every pending and later request fails with this error,
    which names the cause (also its ``__cause__``)."""


class EngineHung(RuntimeError):
    """An engine step ran past ``rl.vllm.step_timeout`` (the loop dies of it)."""


FIRST_STEP_LIMIT = 600.0
"""Seconds an engine's first step may take, whatever the step limit below this (see the
module); ``rl.startup_timeout``'s default."""


class StepClock:
    """When the engine step in progress began, and whether it has run too long."""

    def __init__(self, limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        """Seconds a step may take (0: never judged hung)."""
        self._clock = clock
        self._since: float | None = None
        self._warm = False
        """Whether a step has returned (the first may take :data:`FIRST_STEP_LIMIT`)."""

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one step (on the loop thread)."""
        self._since = self._clock()
        try:
            yield
            self._warm = True
        finally:
            self._since = None

    def overdue(self) -> str:
        """Why the engine counts as hung ("" if it does not), from any thread."""
        since = self._since
        limit = self.limit if self._warm else max(self.limit, FIRST_STEP_LIMIT)
        if since is None or not self.limit or self._clock() - since <= limit:
            return ""
        first = "" if self._warm else ", its first"
        return (f"vLLM's engine step{first} has not returned in {limit:g}s "
                "(rl.vllm.step_timeout): its engine core hangs")
