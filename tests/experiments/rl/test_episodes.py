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
