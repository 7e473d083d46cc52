"""How a generation engine's loop fails, and the clock that judges its engine core hung.

vLLM notices an engine core that died (its monitor sets ``engine_dead``), not one that lives
but never answers: stopped (SIGSTOP, a frozen container), deadlocked, stuck in a device call.
Its client then waits for the step's outputs forever, and the server would heart-beat on with
an engine that answers nothing. :class:`StepClock` times each step and control task; the
engine's watch asks it whether the one in progress has run past its limit (a step:
``rl.vllm.step_timeout``). Pure but for the clock.

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
    """An engine step ran past ``rl.vllm.step_timeout``, or a control task (a weight update)
    past its limit (the loop dies of it)."""


FIRST_STEP_LIMIT = 600.0
"""Seconds an engine's first step may take, whatever the step limit below this (see the
module); ``rl.startup_timeout``'s default."""


class StepClock:
    """When the engine step (or control task) in progress began, and whether it has run too
    long."""

    def __init__(self, limit: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        """Seconds a step may take (0: never judged hung)."""
        self.control_limit = 0.0
        """Seconds a control task may take (0: never judged hung): a weight update waits for
        the trainer's send, which the master waits for (``rl.call_timeout``; a group's set-up:
        twice ``rl.weight_sync.timeout``); it drops the server then, and one whose update
        still ran heart-beat on, out of routing."""
        self._clock = clock
        self._running: tuple[str, str, float, float] | None = None
        """What runs (its words in a message), the key that sets its limit, since when, and the
        limit: one write, read by the watch thread at any time."""
        self._warm = False
        """Whether a step has returned (the first may take :data:`FIRST_STEP_LIMIT`)."""

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one step (on the loop thread)."""
        limit = self.limit if self._warm or not self.limit else max(self.limit, FIRST_STEP_LIMIT)
        first = "" if self._warm else ", its first"
        with self._timing(f"vLLM's engine step{first}", limit, "rl.vllm.step_timeout"):
            yield
        self._warm = True

    @contextmanager
    def control(self) -> Iterator[None]:
        """Time one control task (on the loop thread)."""
        with self._timing("a control task of vLLM's engine (a weight update or its group's "
                          "set-up)", self.control_limit,
                          "rl.call_timeout; a set-up: 2 x rl.weight_sync.timeout"):
            yield

    @contextmanager
    def _timing(self, what: str, limit: float, key: str) -> Iterator[None]:
        self._running = (what, key, self._clock(), limit)
        try:
            yield
        finally:
            self._running = None

    def overdue(self) -> str:
        """Why the engine counts as hung ("" if it does not), from any thread."""
        running = self._running
        if running is None:
            return ""
        doing, key, since, limit = running
        if not limit or self._clock() - since <= limit:
            return ""
        return f"{doing} has not returned in {limit:g}s ({key}): its engine core hangs"
