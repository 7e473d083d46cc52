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
    t, s = 7.0, 4  # loss tokens, sequences
    assert loss_weights(MASKS, "token-mean", 16) is None
    w = loss_weights(MASKS, "seq-mean-token-mean", 16)
    assert [x.tolist() for x in w] == [[t / (s * 4)] * 4, [t / (s * 2)] * 3, [0.0, 0.0],
                                       [t / s]]
    assert all(x.dtype == np.float32 for x in w)
    assert {float(x) for m in loss_weights(MASKS, "seq-mean-token-sum", 16) for x in m} == {t / s}
    norm = [float(x) for m in loss_weights(MASKS, "seq-mean-token-sum-norm", 16) for x in m]
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
    direct = {
        "token-mean": sum(x.sum() for x in tokens) / sum(lengths),
        "seq-mean-token-mean": np.mean([x.sum() / n if n else 0.0
                                        for x, n in zip(tokens, lengths)]),
        "seq-mean-token-sum": np.mean([x.sum() for x in tokens]),
        "seq-mean-token-sum-norm": np.mean([x.sum() for x in tokens]) / 16,
    }[aggregation]
    assert total / sum(lengths) == pytest.approx(float(direct), rel=1e-5)
