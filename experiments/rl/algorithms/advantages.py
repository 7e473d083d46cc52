"""Advantage estimators (pure array functions, float32). numpy, not torch: they run on the
master, which then needs no torch (1.5 CPU-s of its start on two cores) for a few hundred
numbers a step."""
from __future__ import annotations

import numpy as np


def grpo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6,
                    scale: bool = True) -> np.ndarray:
    """Group-normalised advantages: each sample's reward minus its group's mean (the ``n``
    samples of one prompt are consecutive), divided by the group's standard deviation when
    ``scale``. A group whose rewards are all equal gets zeros."""
    rewards = np.asarray(rewards)
    if rewards.ndim != 1 or rewards.size % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} are not groups of {group_size}")
    g = rewards.astype(np.float32).reshape(-1, group_size)
    adv = g - g.mean(axis=1, keepdims=True)
    if scale:
        adv = adv / (g.std(axis=1, keepdims=True) + np.float32(eps))
    return adv.reshape(-1)


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation over padded sequences ``[batch, time]``: ``mask`` marks
    the generated tokens; the value after the last one is 0. Returns (advantages, returns)."""
    rewards, values, mask = np.asarray(rewards), np.asarray(values), np.asarray(mask)
    if not (rewards.shape == values.shape == mask.shape):
        raise ValueError("rewards, values and mask must have the same shape")
    b, t = rewards.shape
    f32 = np.float32
    r, v, m = rewards.astype(f32), values.astype(f32), mask.astype(f32)
    gamma, gl = f32(gamma), f32(gamma * lam)
    adv = np.zeros((b, t), f32)
    last = np.zeros(b, f32)
    next_value = np.zeros(b, f32)
    for i in reversed(range(t)):
        mi = m[:, i]
        delta = r[:, i] + gamma * next_value - v[:, i]
        last = (delta + gl * last) * mi + last * (1 - mi)
        adv[:, i] = last * mi
        next_value = v[:, i] * mi + next_value * (1 - mi)
    return adv, adv + v * m
