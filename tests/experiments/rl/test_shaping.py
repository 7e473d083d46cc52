"""Reward shaping into advantages (PPO and GRPO)."""
from __future__ import annotations

import numpy as np

from experiments.rl.config import RLConfig


def test_ppo_advantages_whitened_over_policy_tokens():
    from experiments.rl.shaping import advantages_grpo, advantages_ppo

    trajs = [{"prompt_len": 2, "mask": np.array([1, 1, 0, 1], np.float32), "reward": 1.0},
             {"prompt_len": 2, "mask": np.array([1, 1], np.float32), "reward": 0.0}]
    values = [np.zeros(5, np.float32), np.zeros(3, np.float32)]
    adv, ret = advantages_ppo(trajs, values, RLConfig(algorithm="ppo"))
    assert ret[0].tolist() == [1.0, 1.0, 0.0, 1.0] and ret[1].tolist() == [0.0, 0.0]
    assert adv[0][2] == 0.0 and adv[0][0] > 0 > adv[1][0]
    g = advantages_grpo([{"reward": r, "mask": np.ones(2)} for r in (1, 0, 0, 0)], 4)
    assert g[0][0] > 0 and g[1][0] < 0 and len(g[0]) == 2
