"""DAPO's overlong reward shaping: the soft punishment's ramp over the buffer, what the
advantages and the metrics see, overlong filtering's masks, and an agent function refused."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.rl.algorithms.overlong import overlong_penalty
from system.errors import ConfigError


def test_the_punishment_ramps_over_the_last_buffer_tokens_of_the_budget():
    lengths = np.array([0, 12, 16, 17, 18, 20])
    got = overlong_penalty(lengths, budget=20, buffer=4, penalty=0.5)
    assert got.tolist() == pytest.approx([0, 0, 0, -0.125, -0.25, -0.5])
    assert overlong_penalty(lengths, 20, 0, 0.5).tolist() == [0.0] * 6  # off
    assert overlong_penalty(lengths, 20, 20, 1.0)[2] == pytest.approx(-0.8)  # the whole budget


def _traj(n: int, reward: float, finish: str) -> dict:
    return {"tokens": np.arange(2 + n), "prompt_len": 2, "mask": np.ones(n, np.int8),
            "logprobs": np.full(n, -0.5, np.float32), "versions": np.zeros(n, np.int32),
            "reward": reward, "finish": finish}


def _step(overrides: list[str], cut_group: bool = False,
          rewards: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)):
    from experiments.rl.state import Admitted, LoopState
    from experiments.rl.train_step import train_step
    from system.launch import build_config
    from tests.experiments.rl.test_train_step import FakeCluster

    rl = build_config("arith-tiny", "t", ["rl.mode=sync", f"rl.batch_size={1 + cut_group}",
                                          "rl.group_size=4", "rl.agent.max_new_tokens=8",
                                          *overrides]).rl
    # equal task rewards; two of the four ran into the budget of 8
    trajs = [_traj(n, r, finish) for n, r, finish in zip(
        (3, 8, 7, 8), rewards, ("stop", "length", "stop", "length"))]
    batch = [(Admitted({"prompt_id": 0, "trajs": trajs}, 0), 0)]
    if cut_group:  # a second group, every trajectory of it cut
        batch.append((Admitted({"prompt_id": 1, "trajs": [_traj(8, float(i % 2), "length")
                                                          for i in range(4)]}, 0), 0))
    cluster = FakeCluster()
    figures = train_step(cluster, rl, batch, LoopState())
    items = [it for critic, step in cluster.steps if not critic for it in step]
    return figures, items, trajs


def test_the_shaped_reward_makes_the_advantages_and_the_task_reward_the_metric():
    figures, items, trajs = _step(["rl.overlong.buffer=4", "rl.overlong.penalty=1"])
    # shaped: 1, 0, 0.25, 0 (mean 0.3125): the short one above, the longer the further below
    adv = [float(it["adv"][0]) for it in items]
    assert adv[0] > 0 > adv[2] > adv[1] == pytest.approx(adv[3])
    assert figures["reward"] == 1.0  # the task's, as the rollouts scored it
    assert [t["reward"] for t in trajs] == [1.0] * 4  # (the group itself is left as it came)
    assert figures["overlong_penalty"] == pytest.approx((0 + 1 + 0.75 + 1) / -4)
    assert figures["truncated_fraction"] == 0.5
    assert all(it["mask"].sum() == len(it["mask"]) for it in items)  # no filtering


def test_overlong_filtering_masks_the_cut_trajectories_only():
    figures, items, _ = _step(["rl.overlong.filter=true"])
    assert [float(it["mask"].sum()) for it in items] == [3.0, 0.0, 7.0, 0.0]
    assert [float(it["adv"][0]) for it in items] == [0.0] * 4  # equal rewards, no shaping
    assert figures["overlong_penalty"] is None and figures["truncated_fraction"] == 0.5


def test_an_agent_function_is_refused_its_budget_is_its_own():
    from system.launch import build_config

    with pytest.raises(ConfigError, match=r"^rl\.overlong needs an agent whose completions"):
        build_config("arith-tiny", "t", ["rl.overlong.filter=true", "rl.agent.kind=openai",
                                         "rl.agent.function=calculator"])
    with pytest.raises(ConfigError, match=r"^rl\.eval_samples and rl\.eval_temperature are not "
                                          r"read with rl\.agent\.kind=openai.*valid: "):
        build_config("arith-tiny", "t", ["rl.eval_samples=4", "rl.eval_temperature=1",
                                         "rl.agent.kind=openai", "rl.agent.function=calculator"])


def test_ppo_whitens_over_the_tokens_it_trains_and_an_all_cut_step_takes_no_step():
    """Filtered trajectories' tokens neither train nor move PPO's advantage whitening; a
    mini-batch of cut trajectories only takes no optimizer step (AdamW's momentum and decay
    would still move the weights)."""
    figures, items, _ = _step(["rl.overlong.filter=true", "rl.algorithm=ppo"],
                              rewards=(1.0, 1.0, 0.0, 0.0))
    adv = np.concatenate([it["adv"][it["mask"] > 0] for it in items])
    assert len(adv) == 10 and abs(float(adv.mean())) < 1e-5  # whitened over 3 + 7 tokens
    assert float(adv.std(ddof=1)) == pytest.approx(1.0, abs=1e-4)
    assert all((it["adv"] == 0).all() for it in items if not it["mask"].any())
    figures, items, _ = _step(["rl.overlong.filter=true", "rl.ppo_minibatches=2"],
                              cut_group=True)
    assert figures["loss"] == 2.0  # one optimizer step (the FakeCluster's first), not two
