"""Advantage estimators."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.rl.algorithms.advantages import gae, grpo_advantages


def test_grpo_advantages():
    r = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(r, 4)
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv[:4], [1.0, -1.0, -1.0, 1.0], atol=1e-4)
    assert np.all(adv[4:] == 0)
    np.testing.assert_allclose(grpo_advantages(r, 4, scale=False)[:4], [0.5, -0.5, -0.5, 0.5])
    with pytest.raises(ValueError):
        grpo_advantages(r, 3)


def test_grpo_advantages_match_the_torch_formula():
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(0).normal(size=24).astype(np.float32)
    g = torch.tensor(r).view(-1, 6)
    want = ((g - g.mean(dim=1, keepdim=True))
            / (g.std(dim=1, unbiased=False, keepdim=True) + 1e-6)).view(-1).numpy()
    np.testing.assert_allclose(grpo_advantages(r, 6), want, rtol=1e-5, atol=1e-6)


def _gae_reference(rewards, values, gamma, lam):
    adv, last, nxt = [0.0] * len(rewards), 0.0, 0.0
    for i in reversed(range(len(rewards))):
        delta = rewards[i] + gamma * nxt - values[i]
        last = delta + gamma * lam * last
        adv[i], nxt = last, values[i]
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_reference_with_padding(gamma, lam):
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(2, 6)), rng.normal(size=(2, 6))
    mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    assert adv.dtype == ret.dtype == np.float32
    for b, n in ((0, 6), (1, 4)):
        want = _gae_reference(rewards[b, :n].tolist(), values[b, :n].tolist(), gamma, lam)
        np.testing.assert_allclose(adv[b, :n], want, atol=1e-5)
        assert np.all(adv[b, n:] == 0)
    np.testing.assert_allclose(ret * mask, (adv + values) * mask, atol=1e-6)
