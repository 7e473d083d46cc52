"""The (decoupled) PPO policy objective, token level.

With asynchronous rollouts the behaviour policy (the weights that generated a token, possibly
several versions old) differs from the proximal policy (the current weights before this step's
update, whose log-probs the trainer recomputes). As in AReaL's decoupled PPO, the clipped ratio
is taken against the proximal policy and the whole term is importance-weighted by
``pi_prox / pi_behav`` (optionally capped), so stale samples stay usable without letting one
update move far from the current policy.
"""
from __future__ import annotations

import torch


LOG_RATIO_BOUND = 20.0
"""Log-ratios are clamped to +-this before ``exp`` (as verl does): a token whose log-probs
parted by more (a broken or far-stale behaviour log-prob) gets a large, finite ratio with no
gradient through it, not an infinity whose loss, and every weight after it, turns NaN."""


K3_BOUND = 10.0
"""The largest k3 KL estimate of one token (verl's)."""


def bounded_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log-ratio clamped to +-:data:`LOG_RATIO_BOUND`."""
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float = 0.2,
                    prox_logp: torch.Tensor | None = None,
                    behav_imp_weight_cap: float | None = None, clip_eps_high: float | None = None,
                    dual_clip: float | None = None, weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict]:
    """Mean over masked tokens of the clipped surrogate. ``old_logp`` are the behaviour
    log-probs; ``prox_logp`` the recomputed proximal ones (``None``: standard PPO).

    The ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]`` (DAPO's clip-higher; None:
    symmetric). ``dual_clip`` (> 1; None: off) bounds a token's loss under a negative advantage
    by ``dual_clip * |A|`` (dual-clip PPO), so a token the policy moved far up does not blow the
    loss up. ``weights``: per-token weights of the loss terms (the loss aggregation; None: 1);
    the statistics are plain token means (``clip_fraction``: the tokens whose term the clip
    took, as verl counts them: not those out of range on the side that is not clipped)."""
    mask = mask.float()
    n = mask.sum().clamp(min=1.0)
    anchor = old_logp if prox_logp is None else prox_logp
    ratio = bounded_exp(logp - anchor)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
    if dual_clip is not None:
        bounded = torch.minimum(token_loss, -dual_clip * advantages)
        token_loss = torch.where(advantages < 0, bounded, token_loss)
    weight = torch.ones_like(ratio)
    if prox_logp is not None:
        weight = bounded_exp(prox_logp - old_logp).detach()
        if behav_imp_weight_cap is not None:
            weight = torch.where(weight > behav_imp_weight_cap, torch.zeros_like(weight), weight)
    terms = weight * token_loss * mask
    loss = (terms if weights is None else terms * weights).sum() / n
    with torch.no_grad():
        active = (clipped * advantages < ratio * advantages).float()  # the clip took the term
        stats = {"clip_fraction": float((active * mask).sum() / n),
                 "ratio_mean": float((ratio * mask).sum() / n),
                 "behav_weight_mean": float((weight * mask).sum() / n)}
        if dual_clip is not None:
            stats["dual_clip_fraction"] = float(
                ((advantages < 0) & (ratio > dual_clip)).float().mul(mask).sum() / n)
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3). k3's
    log-ratio is clamped to +-:data:`LOG_RATIO_BOUND` before ``exp`` and the estimate to at
    most 10 (as verl's low_var_kl): a token the two models part far on (more likely at a low
    temperature, which scales the gap) weighs a bounded amount, not an infinity."""
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        d = torch.clamp(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(d) - 1 - d, max=K3_BOUND)
    raise ValueError(f"kl kind {kind!r} is not one of k1, k2, k3")
