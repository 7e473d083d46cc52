"""A batch with non-finite behaviour log-probs is refused before any weight changes."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.rl.train_step import NonFiniteTraining, check_behaviour_logprobs


def traj(logprobs: list[float], mask: list[int], version: int = 3) -> dict:
    n = len(logprobs)
    return {"tokens": np.arange(2 + n), "prompt_len": 2, "mask": np.array(mask, np.int8),
            "logprobs": np.array(logprobs, np.float32), "versions": np.full(n, version),
            "reward": 0.0}


def test_finite_log_probs_pass_and_masked_tool_tokens_do_not_count():
    check_behaviour_logprobs([traj([-0.1, -2.0], [1, 1]),
                              traj([-0.5, float("nan"), -1.0], [1, 0, 1])], step=4)


def test_a_nan_log_prob_from_generation_names_the_step_count_and_versions():
    trajs = [traj([-0.1, -2.0], [1, 1]), traj([float("nan"), -1.0], [1, 1], version=7),
             traj([-0.1, float("-inf")], [1, 1], version=7)]
    with pytest.raises(NonFiniteTraining) as e:
        check_behaviour_logprobs(trajs, step=5)
    assert str(e.value).startswith("step 5: 2 of 3 samples carry non-finite log-probs")
    assert "versions [7]" in str(e.value)
