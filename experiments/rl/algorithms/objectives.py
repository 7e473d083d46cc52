"""Per-micro-batch loss functions the model workers run, built from a batch the master sent.

A batch holds, per sequence: ``prompt_len`` and arrays over its completion tokens (``mask``: 1
for tokens the policy generated, 0 for tool output; ``old_logp``: behaviour log-probs;
``adv``: advantages; optionally ``prox_logp`` (decoupled PPO), ``ref_logp`` (KL in the loss),
``loss_weight`` (the loss aggregation's per-token weights, see
:mod:`experiments.rl.algorithms.aggregation`), ``old_values`` and ``returns`` (critic)).
Every function returns the *sum* of token losses (weighted, where weights are given), as
:meth:`~workers.engines.torch_engine.TorchEngine.train_step` expects.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

from system.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where the losses run (model workers), not by the launcher
    import torch


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm")


@dataclasses.dataclass
class ActorLossConfig:
    """The policy objective."""

    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float = 0.0
    """The upper clip (DAPO's clip-higher, 0.28 in its paper): lets unlikely tokens gain
    probability faster than likely ones lose it; 0: clip_eps (symmetric). The clips act on
    ratios away from 1: with rl.ppo_minibatches > 1, or against the behaviour policy
    (proximal=off); the decoupled loss's ratio with one step a batch is 1 (refused there)."""
    dual_clip: float = 0.0
    """Dual-clip PPO: under a negative advantage a token's loss is at most dual_clip * |A| (its
    ratio counts up to dual_clip, 3 in the paper); 0: off, else > 1. Acts where
    clip_eps_high does."""
    aggregation: str = "token-mean"
    """How token losses make the batch's loss: token-mean (every token of the batch weighs the
    same), seq-mean-token-mean (each sequence's token mean, averaged over sequences: GRPO's
    paper), seq-mean-token-sum (each sequence's token sum, averaged) or
    seq-mean-token-sum-norm (the token sums averaged, divided by rl.agent.max_new_tokens: Dr.
    GRPO's constant normaliser). A sequence is an agent's session; a step's batch is a
    mini-batch with rl.ppo_minibatches."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference model in the loss (0: no reference model)."""
    kl_kind: str = "k3"
    """KL estimator: k1, k2 or k3."""
    behav_imp_weight_cap: float = 5.0
    """Decoupled PPO: tokens whose pi_prox / pi_behav exceeds this are masked (0: no cap)."""
    proximal: str = "forward"
    """Decoupled PPO's proximal log-probs (the weights before this step's update): forward
    (the training forward's own log-probs, detached: exact, since every batch takes one
    optimizer step after all its forwards, and it saves a pass; exact for a model without
    dropout, as the built-in ones: with dropout the forward's log-probs are noisy, use
    recompute), recompute (a separate
    log-prob pass before the step, as AReaL does), or off (standard PPO against the behaviour
    log-probs; what sync mode and ``rl.decoupled_loss=false`` use)."""

    def __post_init__(self) -> None:
        if self.clip_eps <= 0:
            raise ConfigError(f"clip_eps must be > 0, got {self.clip_eps}")
        if self.clip_eps_high < 0:
            raise ConfigError(f"clip_eps_high={self.clip_eps_high} is not valid; valid: 0 "
                              "(clip_eps) or > 0")
        if self.dual_clip != 0 and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip={self.dual_clip} is not valid; valid: 0 (off) or > 1 "
                              "(it bounds the loss of ratios above it)")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation={self.aggregation!r} is not one of "
                              f"{', '.join(AGGREGATIONS)}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.behav_imp_weight_cap != 0 and self.behav_imp_weight_cap <= 1:
            raise ConfigError(f"behav_imp_weight_cap={self.behav_imp_weight_cap} would mask the "
                              "tokens of fresh samples (their weight is about 1); valid: 0 (no "
                              "cap) or a number > 1")
        if self.proximal not in ("forward", "recompute", "off"):
            raise ConfigError(f"proximal={self.proximal!r} is not one of forward, recompute, off")
        if self.kl_kind not in ("k1", "k2", "k3"):
            raise ConfigError(f"kl_kind={self.kl_kind!r} is not one of k1, k2, k3")


def _cat(batch: Sequence[dict[str, Any]], idx: Sequence[int], key: str) -> torch.Tensor:
    import torch

    return torch.cat([torch.as_tensor(batch[i][key], dtype=torch.float32) for i in idx])


def _completion(outs: Sequence[torch.Tensor], batch: Sequence[dict[str, Any]],
                idx: Sequence[int]) -> torch.Tensor:
    """The outputs at the completion tokens (position p predicts token p + 1)."""
    import torch

    return torch.cat([o[int(batch[i]["prompt_len"]) - 1:] for o, i in zip(outs, idx)])


def actor_loss(batch: Sequence[dict[str, Any]], cfg: ActorLossConfig, stats: dict[str, float]
               ) -> Callable[[list[torch.Tensor], list[int]], torch.Tensor]:
    from experiments.rl.algorithms.ppo import kl_penalty, ppo_policy_loss

    def fn(logps: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
        logp = _completion(logps, batch, idx)
        dev = logp.device
        mask = _cat(batch, idx, "mask").to(dev)
        old = _cat(batch, idx, "old_logp").to(dev)
        adv = _cat(batch, idx, "adv").to(dev)
        prox = (_cat(batch, idx, "prox_logp").to(dev) if "prox_logp" in batch[idx[0]]
                else logp.detach() if cfg.proximal == "forward" else None)
        weights = (_cat(batch, idx, "loss_weight").to(dev) if "loss_weight" in batch[idx[0]]
                   else None)
        n = mask.sum()
        loss, st = ppo_policy_loss(logp, old, adv, mask, cfg.clip_eps, prox,
                                   cfg.behav_imp_weight_cap or None, cfg.clip_eps_high or None,
                                   cfg.dual_clip or None, weights)
        total = loss * n.clamp(min=1.0)
        if cfg.kl_coef > 0 and "ref_logp" in batch[idx[0]]:
            ref = _cat(batch, idx, "ref_logp").to(dev)
            kl = kl_penalty(logp, ref, cfg.kl_kind) * mask
            total = total + cfg.kl_coef * (kl if weights is None else kl * weights).sum()
            stats["kl_sum"] = stats.get("kl_sum", 0.0) + float(kl.detach().sum())
        for k, v in st.items():
            stats[k + "_sum"] = stats.get(k + "_sum", 0.0) + v * float(n)
        # the trainer's log-probs against vLLM's of the same tokens (training-inference mismatch)
        stats["logp_mismatch_sum"] = stats.get("logp_mismatch_sum", 0.0) + float(
            ((logp.detach() - old).abs() * mask).sum())
        stats["tokens"] = stats.get("tokens", 0.0) + float(n)
        return total
    return fn


def critic_loss(batch: Sequence[dict[str, Any]], value_clip: float, stats: dict[str, float]
                ) -> Callable[[list[torch.Tensor], list[int]], torch.Tensor]:
    """Clipped value regression (PPO): 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)."""
    import torch

    def fn(values: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
        v = _completion(values, batch, idx)
        dev = v.device
        mask = _cat(batch, idx, "mask").to(dev)
        ret = _cat(batch, idx, "returns").to(dev)
        old = _cat(batch, idx, "old_values").to(dev)
        clipped = old + (v - old).clamp(-value_clip, value_clip)
        err = torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
        loss = 0.5 * (err * mask).sum()
        stats["value_loss_sum"] = stats.get("value_loss_sum", 0.0) + float(loss.detach())
        stats["tokens"] = stats.get("tokens", 0.0) + float(mask.sum())
        return loss
    return fn
