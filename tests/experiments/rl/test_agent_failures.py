"""When an agent function's failures stop being retried: per prompt, and in a row."""
from __future__ import annotations

import random

from experiments.rl.agent_failures import PROMPT_TRIES, AgentFailures, run_limit


def test_a_prompt_is_skipped_after_its_tries_and_a_success_clears_it():
    f = AgentFailures(batch_size=4)
    assert [f.failed(7) for _ in range(PROMPT_TRIES)] == ["retry"] * (PROMPT_TRIES - 1) + ["skip"]
    assert f.failed(8) == "retry"
    f.accepted(8)  # the function works again: prompt 8 starts over, the run ends
    assert f.in_a_row == 0 and f.failed(8) == "retry" and f.failed(8) == "retry"
    f.accepted(9)  # another prompt's success ends the run, not prompt 8's count
    assert f.in_a_row == 0 and f.failed(8) == "skip"


def test_a_function_that_always_fails_stops_the_trial_after_a_run_of_failures():
    assert run_limit(4) == 24 and run_limit(16) == 48
    f = AgentFailures(batch_size=4)
    verdicts = [f.failed(pid) for pid in range(24)]  # every prompt fails once, none accepted
    assert verdicts == ["retry"] * 23 + ["stop"]


def test_a_function_that_fails_half_the_time_trains_on():
    rng = random.Random(0)
    f = AgentFailures(batch_size=8)
    for _ in range(20000):
        pid = rng.randrange(100)
        if rng.random() < 0.5:
            assert f.failed(pid) != "stop"
        else:
            f.accepted(pid)
