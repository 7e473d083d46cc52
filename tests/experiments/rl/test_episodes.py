"""Scoring episodes."""
from __future__ import annotations

import numpy as np

from experiments.rl.rewards import first_int_reward
from tests.helpers import CharTok


def test_reward_reads_the_final_turn():
    from experiments.rl.episodes import score

    tok = CharTok()
    prompt = [1] + tok.encode("3*4=")
    comp = tok.encode("[3*4]12") + tok.encode("12")
    traj = {"tokens": np.array(prompt + comp, np.int32), "prompt_len": len(prompt),
            "mask": np.array([1] * 5 + [0, 0] + [1, 1], np.int8)}
    score([traj], tok, 12, first_int_reward)
    assert traj["reward"] == 1.0
    single = {"tokens": np.array(prompt + tok.encode("12"), np.int32),
              "prompt_len": len(prompt), "mask": np.ones(2, np.int8)}
    score([single], tok, 12, first_int_reward)
    assert single["reward"] == 1.0


def test_a_reward_that_raises_or_returns_no_finite_number_is_a_config_error():
    import pytest

    from experiments.rl.episodes import score
    from system.errors import ConfigError

    tok = CharTok()
    prompt = [1] + tok.encode("1+1=")

    def traj():
        return {"tokens": np.array(prompt + tok.encode("2"), np.int32),
                "prompt_len": len(prompt), "mask": np.ones(1, np.int8)}

    for value, shown in ((float("nan"), "'nan'"), (float("inf"), "'inf'"), ("1", "'1'"),
                         (None, "'None'"), (True, "'True'")):
        with pytest.raises(ConfigError) as e:
            score([traj()], tok, 2, lambda c, a, v=value: v)
        assert f"returned {shown} on the completion '2' (answer '2'); valid: a finite" \
            in str(e.value)

    def broken(c, a):
        raise KeyError("boom")

    with pytest.raises(ConfigError, match=r"test_episodes\..*broken \(rl.task.reward, or the "
                                          r"task's own\) raised KeyError: 'boom'"):
        score([traj()], tok, 2, broken)
    t = traj()
    score([t], tok, 2, lambda c, a: np.float32(0.5))  # numpy numbers are numbers
    assert t["reward"] == 0.5 and isinstance(t["reward"], float)
