"""Reward shaping into advantages (PPO and GRPO)."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.rl.config import RLConfig


def test_ppo_advantages_whitened_over_policy_tokens():
    from experiments.rl.shaping import advantages_grpo, advantages_ppo

    trajs = [{"prompt_len": 2, "mask": np.array([1, 1, 0, 1], np.float32), "reward": 1.0},
             {"prompt_len": 2, "mask": np.array([1, 1], np.float32), "reward": 0.0}]
    values = [np.zeros(5, np.float32), np.zeros(3, np.float32)]
    adv, ret = advantages_ppo(trajs, values, RLConfig(algorithm="ppo"))
    assert ret[0].tolist() == [1.0, 1.0, 0.0, 1.0] and ret[1].tolist() == [0.0, 0.0]
    assert adv[0][2] == 0.0 and adv[0][0] > 0 > adv[1][0]
    g = advantages_grpo([[{"reward": r, "mask": np.ones(2)} for r in (1, 0, 0, 0)]], 4)
    assert g[0][0] > 0 and g[1][0] < 0 and len(g[0]) == 2


def test_grpo_normalises_over_sessions_not_trajectories():
    """A session that split into two trajectories counts once: both get its advantage, and the
    other sessions' advantages are what they would be without the split."""
    from experiments.rl.shaping import advantages_grpo

    def t(reward, session, n=2):
        return {"reward": reward, "mask": np.ones(n), "session": session}

    split = [t(1.0, 0), t(1.0, 0, 3), t(0.0, 1), t(0.0, 2), t(1.0, 3)]
    plain = [{"reward": r, "mask": np.ones(2)} for r in (1.0, 0.0, 0.0, 1.0)]
    a = advantages_grpo([split, plain], 4)
    assert len(a) == 9 and len(a[1]) == 3
    assert a[0][0] == a[1][0] == a[4][0] > 0 > a[2][0] == a[3][0]
    assert [x[0] for x in a[5:]] == [a[0][0], a[2][0], a[3][0], a[4][0]]


def test_grpo_without_std_normalisation_keeps_the_centred_rewards():
    """rl.group_std_norm=false (Dr. GRPO): advantages are reward minus the group's mean."""
    from experiments.rl.shaping import advantages_grpo

    group = [{"reward": r, "mask": np.ones(2)} for r in (1.0, 0.0, 0.0, 0.0)]
    raw = advantages_grpo([group], 4, scale=False)
    assert [float(a[0]) for a in raw] == [0.75, -0.25, -0.25, -0.25]
    scaled = advantages_grpo([group], 4)
    assert float(scaled[0][0]) == pytest.approx(0.75 / np.sqrt(0.1875), rel=1e-5)
