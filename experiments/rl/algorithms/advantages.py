"""Advantage estimators (pure tensor functions)."""
from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                    scale: bool = True) -> torch.Tensor:
    """Group-normalised advantages: each sample's reward minus its group's mean (the ``n``
    samples of one prompt are consecutive), divided by the group's standard deviation when
    ``scale``. A group whose rewards are all equal gets zeros."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not groups of {group_size}")
    g = rewards.float().view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (g.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over padded sequences ``[batch, time]``: ``mask`` marks
    the generated tokens; the value after the last one is 0. Returns (advantages, returns)."""
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError("rewards, values and mask must have the same shape")
    b, t = rewards.shape
    mask = mask.float()
    adv = torch.zeros_like(values, dtype=torch.float32)
    last = torch.zeros(b, dtype=torch.float32, device=values.device)
    next_value = torch.zeros(b, dtype=torch.float32, device=values.device)
    for i in reversed(range(t)):
        m = mask[:, i]
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        last = (delta + gamma * lam * last) * m + last * (1 - m)
        adv[:, i] = last * m
        next_value = values[:, i] * m + next_value * (1 - m)
    return adv, adv + values.float() * mask
