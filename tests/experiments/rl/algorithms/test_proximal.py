"""Decoupled PPO's proximal log-probs taken from the training forward (``rl.loss.proximal=
forward``) give the same update as a separate log-prob pass before the step (``recompute``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from experiments.rl.algorithms.objectives import ActorLossConfig, actor_loss
from system.errors import ConfigError
from workers.engines.torch_engine import TorchEngine, TorchEngineConfig


def _batch(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(6):
        n, p = int(rng.integers(6, 14)), int(rng.integers(2, 5))
        comp = n - p
        out.append({"tokens": rng.integers(0, 100, n).astype(np.int64), "prompt_len": p,
                    "mask": (rng.random(comp) < 0.8).astype(np.float32),
                    # behaviour log-probs of an older policy: the weights differ from 1
                    "old_logp": (-rng.random(comp) * 3).astype(np.float32),
                    "adv": rng.standard_normal(comp).astype(np.float32)})
    return out


def _step(model_dir: str, proximal: str) -> tuple[dict, list[torch.Tensor]]:
    torch.manual_seed(0)
    eng = TorchEngine(TorchEngineConfig(model_path=model_dir, lr=1e-3,
                                        max_tokens_per_microbatch=30))  # several micro-batches
    batch = _batch()
    seqs = [torch.as_tensor(b["tokens"]) for b in batch]
    if proximal == "recompute":
        for b, lp in zip(batch, eng.logprobs(seqs)):
            b["prox_logp"] = lp.numpy()[b["prompt_len"] - 1:]
    stats: dict[str, float] = {}
    tokens = int(sum(b["mask"].sum() for b in batch))
    eng.train_step(seqs, actor_loss(batch, ActorLossConfig(proximal=proximal), stats), tokens)
    return stats, [p.detach().clone() for p in eng.model.parameters()]


def test_forward_proximal_equals_recomputed(tiny_model_dir):
    s_fwd, p_fwd = _step(tiny_model_dir, "forward")
    s_rec, p_rec = _step(tiny_model_dir, "recompute")
    s_off, p_off = _step(tiny_model_dir, "off")
    for a, b in zip(p_fwd, p_rec):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for k in ("behav_weight_mean_sum", "clip_fraction_sum", "tokens"):
        assert s_fwd[k] == pytest.approx(s_rec[k], rel=1e-5), k
    # and the decoupled objective is not the standard one: the importance weights matter
    assert s_off["behav_weight_mean_sum"] == pytest.approx(s_off["tokens"])
    assert s_fwd["behav_weight_mean_sum"] != pytest.approx(s_fwd["tokens"], rel=1e-3)
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(p_fwd, p_off))


def test_proximal_is_validated():
    with pytest.raises(ConfigError, match="proximal='again' is not one of forward, recompute"):
        ActorLossConfig(proximal="again")
