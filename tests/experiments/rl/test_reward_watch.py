"""The deadline on reward functions (``rl.task.reward_timeout``)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from experiments.rl.episodes import score
from experiments.rl.reward_watch import RewardWatch
from experiments.rl.task_api import TaskConfig
from system.errors import ConfigError
from tests.helpers import CharTok


def _traj(tok: CharTok) -> dict:
    prompt = [1] + tok.encode("1+1=")
    return {"tokens": np.array(prompt + tok.encode("2"), np.int32), "prompt_len": len(prompt),
            "mask": np.ones(1, np.int8)}


def test_a_reward_that_never_returns_is_named_once_its_time_is_up():
    """The call runs on in the caller's thread (it cannot be interrupted): the watchdog names
    it, with its input, once it has run past the timeout, so the worker can report it and end
    (it hung silently, for ever, its leases handed out again to the next call that hung)."""
    said: list[str] = []
    expired = threading.Event()
    release = threading.Event()
    watch = RewardWatch(0.3, lambda m: (said.append(m), expired.set()), period=0.05)
    tok = CharTok()

    def hangs(completion, answer):
        release.wait(10)  # (a hung verifier; let go once named, to end the test)
        return 1.0

    t0 = time.monotonic()
    done = threading.Thread(target=score, args=([_traj(tok)], tok, 2, hangs),
                            kwargs={"watch": watch})
    done.start()
    assert expired.wait(5)
    release.set()
    done.join(5)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert len(said) == 1 and said[0].startswith(
        "the reward function tests.experiments.rl.test_reward_watch.test_a_reward_that_never_"
        "returns_is_named_once_"
        "its_time_is_up.<locals>.hangs (rl.task.reward, or the task's own), on the completion "
        "'2' (answer '2'), did not return within 0.3s (rl.task.reward_timeout); valid: "), said


def test_rewards_that_return_in_time_are_left_alone():
    said: list[str] = []
    # (1 s for each call of 0.05 s, 1.5 s in all: the limit is each call's, and one stalled a
    # fraction of a second by a loaded machine must not be named)
    watch = RewardWatch(1.0, said.append, period=0.05)
    tok = CharTok()
    trajs = [_traj(tok) for _ in range(30)]
    score(trajs, tok, 2, lambda c, a: (time.sleep(0.05), 1.0)[1], watch=watch)
    time.sleep(0.3)  # (the watchdog has looked several times since the last call)
    assert said == [] and all(t["reward"] == 1.0 for t in trajs)
    off = RewardWatch(0, said.append, period=0.05)  # 0: no limit, no watchdog
    score([_traj(tok)], tok, 2, lambda c, a: (time.sleep(0.3), 1.0)[1], watch=off)
    assert said == [] and off._thread is None


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_the_timeout_is_seconds_or_zero(value):
    with pytest.raises(ConfigError, match="reward_timeout must be >= 0 seconds"):
        TaskConfig(reward_timeout=value)
