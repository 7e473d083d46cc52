"""Advantage estimators."""
from __future__ import annotations

import pytest
import torch

from experiments.rl.algorithms.advantages import gae, grpo_advantages


def test_grpo_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(r, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.all(adv[4:] == 0)
    assert torch.allclose(grpo_advantages(r, 4, scale=False)[:4],
                          torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError):
        grpo_advantages(r, 3)


def _gae_reference(rewards, values, gamma, lam):
    adv, last, nxt = [0.0] * len(rewards), 0.0, 0.0
    for i in reversed(range(len(rewards))):
        delta = rewards[i] + gamma * nxt - values[i]
        last = delta + gamma * lam * last
        adv[i], nxt = last, values[i]
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_with_padding(gamma, lam):
    torch.manual_seed(0)
    rewards, values = torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for b, n in ((0, 6), (1, 4)):
        want = _gae_reference(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
        assert torch.allclose(adv[b, :n], torch.tensor(want), atol=1e-5)
        assert torch.all(adv[b, n:] == 0)
    assert torch.allclose(ret * mask, (adv + values) * mask)
