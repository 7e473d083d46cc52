"""Advantage shaping on the master: from a batch's rewards (and values) to per-token advantages.

numpy only: the master imports no torch.
"""
from __future__ import annotations

import numpy as np

from experiments.rl.config import RLConfig
from workers.schema import Trajectory


def advantages_grpo(groups: list[list[Trajectory]], n: int, scale: bool = True
                    ) -> list[np.ndarray]:
    """Per-token advantages of every trajectory of ``groups`` (flattened in order): rewards
    centred over each group's ``n`` sessions (and divided by their standard deviation when
    ``scale``); a trajectory gets its session's advantage (``session``; without it every
    trajectory is its own session)."""
    from experiments.rl.algorithms.advantages import grpo_advantages

    keys = [[t.get("session", i) for i, t in enumerate(g)] for g in groups]
    rewards: list[float] = []
    for g, k in zip(groups, keys):
        first: dict[int, float] = {}
        for s, t in zip(k, g):
            first.setdefault(s, t["reward"])
        rewards += [first[s] for s in sorted(first)]
    adv = grpo_advantages(np.asarray(rewards, np.float32), n, scale=scale)
    adv = adv.reshape(len(groups), n)
    return [np.full(len(t["mask"]), float(adv[j, s]), np.float32)
            for j, (g, k) in enumerate(zip(groups, keys)) for t, s in zip(g, k)]


def advantages_ppo(trajs: list[Trajectory], values: list[np.ndarray], rl: RLConfig
                   ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token rewards (the score on the last policy token, minus the KL penalty folded into the
    loss), GAE over policy tokens, whitened advantages; returns (advantages, returns)."""
    from experiments.rl.algorithms.advantages import gae

    t_max = max(len(t["mask"]) for t in trajs)
    r = np.zeros((len(trajs), t_max), np.float32)
    v = np.zeros((len(trajs), t_max), np.float32)
    m = np.zeros((len(trajs), t_max), np.float32)
    for i, t in enumerate(trajs):
        k = len(t["mask"])
        m[i, :k] = t["mask"]
        v[i, :k] = values[i][t["prompt_len"] - 1:]
        pol = np.nonzero(t["mask"])[0]
        if len(pol):
            r[i, pol[-1]] = t["reward"]
    adv, ret = gae(r, v, m, rl.gamma, rl.lam)
    sel = adv[m > 0]
    if sel.size > 1:  # the sample standard deviation (n - 1)
        adv = (adv - sel.mean()) / (sel.std(ddof=1) + np.float32(1e-6)) * m
    return ([adv[i, :len(t["mask"])] for i, t in enumerate(trajs)],
            [ret[i, :len(t["mask"])] for i, t in enumerate(trajs)])
