"""Loss aggregation: the weights the master sends make the engines' token-sum-over-``T`` the
chosen aggregate, through the real actor loss."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.rl.algorithms.aggregation import loss_weights
from experiments.rl.algorithms.objectives import AGGREGATIONS, ActorLossConfig, actor_loss

MASKS = [np.array([1, 1, 1, 1], np.float32), np.array([1, 0, 1], np.float32),
         np.array([0, 0], np.float32), np.array([1], np.float32)]


def test_weights_per_aggregation():
    t, s = 7.0, 3  # loss tokens, sequences with one (the third has none: verl's S, too)
    assert loss_weights(MASKS, "token-mean", 16) is None
    w = loss_weights(MASKS, "seq-mean-token-mean", 16)
    assert [x.tolist() for x in w] == [pytest.approx([t / (s * 4)] * 4),
                                       pytest.approx([t / (s * 2)] * 3), [0.0, 0.0],
                                       pytest.approx([t / s])]
    assert all(x.dtype == np.float32 for x in w)
    sums = [float(x) for m in loss_weights(MASKS, "seq-mean-token-sum", 16) for x in m]
    assert sums == pytest.approx([t / s] * 10)
    norm = [float(x) for m in loss_weights(MASKS, "seq-mean-token-sum-norm", 16) for x in m]
    sessions = loss_weights(MASKS, "seq-mean-token-mean", 16, sessions=["a", "a", "b", "c"])
    assert [float(x[0]) for x in sessions[:2]] == pytest.approx([t / (2 * 6)] * 2)  # 4 + 2 tokens
    assert norm == pytest.approx([t / (s * 16)] * 10)
    with pytest.raises(ValueError, match="not known"):
        loss_weights(MASKS, "seq-mean", 16)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_the_actor_loss_over_the_batch_tokens_is_the_aggregate(aggregation):
    """Two data-parallel halves, each through ``actor_loss`` as a model worker runs it: their
    sums over the batch's ``T`` tokens equal the aggregate computed directly from the per-token
    losses (on policy, a token's loss is -A)."""
    rng = np.random.default_rng(0)
    batch = []
    for m in MASKS:
        n = len(m)
        batch.append({"tokens": np.arange(2 + n), "prompt_len": 2, "mask": m,
                      "old_logp": np.zeros(n, np.float32),
                      "adv": rng.standard_normal(n).astype(np.float32)})
    for it, w in zip(batch, loss_weights(MASKS, aggregation, 16) or []):
        it["loss_weight"] = w
    cfg = ActorLossConfig(aggregation=aggregation, proximal="off")
    total = 0.0
    for idx in ([0, 2], [1, 3]):
        fn = actor_loss(batch, cfg, {})
        logps = [torch.zeros(len(batch[i]["tokens"]) - 1) for i in idx]  # ratio 1
        total += float(fn(logps, idx))
    tokens = [-(it["adv"] * it["mask"]) for it in batch]  # per-token losses, masked
    lengths = [m.sum() for m in MASKS]
    some = [(x, n) for x, n in zip(tokens, lengths) if n]  # (sequences with a loss token)
    direct = {
        "token-mean": sum(x.sum() for x in tokens) / sum(lengths),
        "seq-mean-token-mean": np.mean([x.sum() / n for x, n in some]),
        "seq-mean-token-sum": np.mean([x.sum() for x, _ in some]),
        "seq-mean-token-sum-norm": np.mean([x.sum() for x, _ in some]) / 16,
    }[aggregation]
    assert total / sum(lengths) == pytest.approx(float(direct), rel=1e-5)


def _one(ratio: float, adv: float, **loss) -> tuple[float, float, dict]:
    """One token, behaviour log-prob 0, through the real actor loss with ``proximal=off``
    (standard PPO: the ratio to the behaviour policy): its loss, gradient and figures."""
    batch = [{"tokens": np.arange(3), "prompt_len": 2, "mask": np.ones(1, np.float32),
              "old_logp": np.zeros(1, np.float32), "adv": np.full(1, adv, np.float32)}]
    stats: dict = {}
    fn = actor_loss(batch, ActorLossConfig(proximal="off", **loss), stats)
    logp = torch.tensor([0.0, float(np.log(ratio))], requires_grad=True)  # (the prompt's 1st)
    total = fn([logp], [0])
    total.backward()
    return float(total.detach()), float(logp.grad[1]), stats


def test_the_actor_loss_passes_clip_higher_and_dual_clip_on():
    assert _one(1.25, 1.0)[1] == 0.0  # clipped at 1.2
    assert _one(1.25, 1.0, clip_eps_high=0.28)[1] != 0.0
    loss, grad, stats = _one(5.0, -1.0, dual_clip=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0 and stats["dual_clip_fraction_sum"] == 1
    assert _one(5.0, -1.0)[0] == pytest.approx(5.0)


def test_the_kl_term_takes_the_aggregations_weights():
    batch = [{"tokens": np.arange(4), "prompt_len": 2, "mask": np.ones(2, np.float32),
              "old_logp": np.zeros(2, np.float32), "adv": np.zeros(2, np.float32),
              "ref_logp": np.full(2, -1.0, np.float32),
              "loss_weight": np.full(2, 3.0, np.float32)}]
    cfg = ActorLossConfig(proximal="off", kl_coef=0.5, kl_kind="k1")
    stats: dict = {}
    total = actor_loss(batch, cfg, stats)([torch.zeros(3)], [0])
    assert float(total) == pytest.approx(0.5 * 3.0 * 2)  # k1 = logp - ref = 1 a token
    assert stats["kl_sum"] == pytest.approx(2.0)  # (the figure: unweighted)
