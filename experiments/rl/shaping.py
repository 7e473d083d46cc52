"""Advantage shaping on the master: from a batch's rewards (and values) to per-token advantages.

torch is imported where the shaping runs (the master), not by the launcher, which imports the
experiment catalog and with it every role.
"""
from __future__ import annotations

import numpy as np

from experiments.rl.config import RLConfig
from workers.schema import Trajectory


def advantages_grpo(groups: list[list[Trajectory]], n: int) -> list[np.ndarray]:
    """Per-token advantages of every trajectory of ``groups`` (flattened in order): rewards
    normalised over each group's ``n`` sessions; a trajectory gets its session's advantage
    (``session``; without it every trajectory is its own session)."""
    import torch

    from experiments.rl.algorithms.advantages import grpo_advantages

    keys = [[t.get("session", i) for i, t in enumerate(g)] for g in groups]
    rewards: list[float] = []
    for g, k in zip(groups, keys):
        first: dict[int, float] = {}
        for s, t in zip(k, g):
            first.setdefault(s, t["reward"])
        rewards += [first[s] for s in sorted(first)]
    adv = grpo_advantages(torch.tensor(rewards), n).view(len(groups), n)
    return [np.full(len(t["mask"]), float(adv[j, s]), np.float32)
            for j, (g, k) in enumerate(zip(groups, keys)) for t, s in zip(g, k)]


def advantages_ppo(trajs: list[Trajectory], values: list[np.ndarray], rl: RLConfig
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token rewards (the score on the last policy token, minus the KL penalty folded into the
    loss), GAE over policy tokens, whitened advantages; returns (advantages, returns)."""
    import torch

    from experiments.rl.algorithms.advantages import gae

    t_max = max(len(t["mask"]) for t in trajs)
    r = torch.zeros(len(trajs), t_max)
    v = torch.zeros(len(trajs), t_max)
    m = torch.zeros(len(trajs), t_max)
    for i, t in enumerate(trajs):
        k = len(t["mask"])
        m[i, :k] = torch.as_tensor(t["mask"], dtype=torch.float32)
        v[i, :k] = torch.as_tensor(values[i][t["prompt_len"] - 1:], dtype=torch.float32)
        pol = np.nonzero(t["mask"])[0]
        if len(pol):
            r[i, pol[-1]] = t["reward"]
    adv, ret = gae(r, v, m, rl.gamma, rl.lam)
    sel = adv[m > 0]
    if sel.numel() > 1:
        adv = (adv - sel.mean()) / (sel.std() + 1e-6) * m
    return ([adv[i, :len(t["mask"])].numpy() for i, t in enumerate(trajs)],
            [ret[i, :len(t["mask"])].numpy() for i, t in enumerate(trajs)])
