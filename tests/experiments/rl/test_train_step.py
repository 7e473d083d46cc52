"""The master's training step: a batch with non-finite behaviour log-probs is refused before any
weight changes; mini-batches, advantages and the loss aggregation's weights."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.rl.algorithms.objectives import ActorLossConfig
from experiments.rl.train_step import NonFiniteTraining, check_behaviour_logprobs


def traj(logprobs: list[float], mask: list[int], version: int = 3) -> dict:
    n = len(logprobs)
    return {"tokens": np.arange(2 + n), "prompt_len": 2, "mask": np.array(mask, np.int8),
            "logprobs": np.array(logprobs, np.float32), "versions": np.full(n, version),
            "reward": 0.0, "finish": "stop"}


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


class FakeCluster:
    """What ``train_step`` calls: records each optimizer step's items (copies) and returns
    figures as model workers would."""

    def __init__(self) -> None:
        self.steps: list[tuple[bool, list[dict]]] = []
        self.asked: list[tuple[str, object]] = []

    def per_token(self, seqs, which, temps=None):
        self.asked.append((which, temps))
        return [np.zeros(len(s) - 1, np.float32) for s in seqs]  # (a value per next token)

    def train(self, items, critic=False):
        self.steps.append((critic, [dict(it) for it in items]))
        tokens = float(sum(it["mask"].sum() for it in items))
        return {"loss": 1.0 + len(self.steps), "grad_norm": 2.0, "tokens": tokens,
                "seconds": 0.5, "train_tokens": tokens}


def _batch(groups: list[list[float]], sessions: bool = False) -> list:
    from experiments.rl.state import Admitted

    out = []
    for g, rewards in enumerate(groups):
        trajs = []
        for j, r in enumerate(rewards):
            t = traj([-0.5] * (2 + j), [1] * (2 + j), version=0)
            t["reward"] = r
            if sessions:
                t["session"] = j // 2  # two trajectories a session
            trajs.append(t)
        out.append((Admitted({"prompt_id": g, "trajs": trajs}, 0), 0))
    return out


def test_mini_batches_take_whole_groups_one_optimizer_step_each():
    from experiments.rl.config import RLConfig
    from experiments.rl.state import LoopState
    from experiments.rl.train_step import train_step

    rl = RLConfig(batch_size=3, group_size=2, ppo_minibatches=2, mode="sync",
                  loss=ActorLossConfig(aggregation="seq-mean-token-mean"))
    cluster = FakeCluster()
    figures = train_step(cluster, rl, _batch([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
                         LoopState())
    assert [len(items) for _, items in cluster.steps] == [2, 4]  # groups 0 | 1, 2
    assert figures["loss"] == (2.0 + 3.0) / 2 and figures["grad_norm"] == 2.0
    for _, items in cluster.steps:  # each step's own aggregate: weights over its sequences
        t = sum(it["mask"].sum() for it in items)
        for it in items:
            assert it["loss_weight"].tolist() == pytest.approx(
                [t / (len(items) * it["mask"].sum())] * len(it["mask"]))
    adv = [float(it["adv"][0]) for _, items in cluster.steps for it in items]
    assert adv[:2] == pytest.approx([1.0, -1.0], rel=1e-5) and adv[4:] == [0.0, 0.0]


def test_advantages_unscaled_and_weights_by_session():
    """rl.group_std_norm=false reaches the advantages; a session split into two trajectories
    is one sequence of the aggregation (its tokens: both trajectories')."""
    from experiments.rl.config import RLConfig
    from experiments.rl.state import LoopState
    from experiments.rl.train_step import train_step

    rl = RLConfig(batch_size=1, group_size=2, group_std_norm=False, mode="sync",
                  loss=ActorLossConfig(aggregation="seq-mean-token-mean"))
    cluster = FakeCluster()
    train_step(cluster, rl, _batch([[1.0, 1.0, 0.0, 0.0]], sessions=True), LoopState())
    (_, items), = cluster.steps
    assert [float(it["adv"][0]) for it in items] == [0.5, 0.5, -0.5, -0.5]  # not +-1
    lengths = [len(it["mask"]) for it in items]  # 2, 3 | 4, 5 tokens
    t = sum(lengths)
    want = [t / (2 * (lengths[0] + lengths[1]))] * 2 + [t / (2 * (lengths[2] + lengths[3]))] * 2
    assert [float(it["loss_weight"][0]) for it in items] == pytest.approx(want)


def test_sampling_temperatures_reach_every_log_prob_pass_and_the_training_step():
    """The trainer's log-probs (proximal, reference, and the step's own) are taken at the
    temperatures the tokens were sampled at; trajectories at 1 carry none."""
    from experiments.rl.config import RLConfig
    from experiments.rl.state import LoopState
    from experiments.rl.train_step import train_step

    rl = RLConfig(batch_size=1, group_size=2, mode="async",
                  loss=ActorLossConfig(proximal="recompute", kl_coef=0.1))
    batch = _batch([[1.0, 0.0]])
    hot = batch[0][0].group["trajs"][1]
    hot["temps"] = np.full(len(hot["mask"]), 0.6, np.float32)
    cluster = FakeCluster()
    train_step(cluster, rl, batch, LoopState())
    assert [w for w, _ in cluster.asked] == ["actor", "ref"]
    for _, temps in cluster.asked:
        assert len(temps[0]) == 0 and temps[1].tolist() == pytest.approx([0.6] * 3)
    (_, items), = cluster.steps
    assert "temps" not in items[0] and items[1]["temps"].tolist() == pytest.approx([0.6] * 3)
    cluster = FakeCluster()
    train_step(cluster, rl, _batch([[1.0, 0.0]]), LoopState())
    assert [t for _, t in cluster.asked] == [None, None]  # all at 1: the plain calls
