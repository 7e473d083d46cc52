"""The clock that judges a generation engine's core hung: a step past the limit, and only one
that is still running."""
from __future__ import annotations

import pytest

from workers.engines.step_clock import FIRST_STEP_LIMIT, StepClock


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_step_warms_the_engine_up_and_gets_longer():
    clock = Clock()
    steps = StepClock(5.0, clock)
    with steps.step():
        clock.now += FIRST_STEP_LIMIT
        assert steps.overdue() == ""
        clock.now += 1.0
        assert f"step, its first has not returned in {FIRST_STEP_LIMIT:g}s" in steps.overdue()
    slow = StepClock(2 * FIRST_STEP_LIMIT, clock)  # a longer limit holds for the first too
    with slow.step():
        clock.now += 1.5 * FIRST_STEP_LIMIT
        assert slow.overdue() == ""


def test_a_slow_first_step_is_judged_at_the_limit_it_began_with():
    """The limit is fixed when a step begins: a first step that ran past the step limit (but
    not the first step's) is not judged at the plain limit as it returns."""
    clock = Clock()
    steps = StepClock(5.0, clock)
    with steps.step():
        clock.now += 60.0
        steps._warm = True  # (what its return does: the watch may read in between)
        assert steps.overdue() == ""


def _warm(steps: StepClock) -> StepClock:
    with steps.step():
        pass
    return steps


def test_only_a_step_still_running_past_the_limit_is_overdue():
    clock = Clock()
    steps = _warm(StepClock(30.0, clock))
    assert steps.overdue() == ""  # no step runs: an idle engine is never hung
    with steps.step():
        clock.now += 30.0
        assert steps.overdue() == ""  # at the limit, not past it
        clock.now += 0.5
        assert steps.overdue() == ("vLLM's engine step has not returned in 30s "
                                   "(rl.vllm.step_timeout): its engine core hangs")
    assert steps.overdue() == ""  # it returned (late): the next step is timed afresh
    clock.now += 1000.0
    assert steps.overdue() == ""


def test_a_step_that_raises_ends_its_timing_and_no_limit_never_judges():
    clock = Clock()
    steps = _warm(StepClock(1.0, clock))
    with pytest.raises(RuntimeError), steps.step():
        raise RuntimeError("engine core died")
    clock.now += 5.0
    assert steps.overdue() == ""
    never = StepClock(0.0, clock)
    with never.step():
        clock.now += 1e6
        assert never.overdue() == ""


def test_a_control_task_is_judged_at_its_own_limit():
    """A weight update waits for the trainer's send: not judged at the step limit, but at the
    master's wait for it (it drops the server then); no control limit, never."""
    clock = Clock()
    steps = _warm(StepClock(5.0, clock))
    with steps.control():
        clock.now += 1000.0
        assert steps.overdue() == ""  # no control limit set
    steps.control_limit = 900.0
    with steps.control():
        clock.now += 900.5
        assert steps.overdue() == (
            "a control task of vLLM's engine (a weight update or its group's set-up) has not "
            "returned in 900s (rl.call_timeout; a set-up: 2 x rl.weight_sync.timeout): its "
            "engine core hangs")
    assert steps.overdue() == ""
