"""Advantage estimators and the PPO objective."""
from __future__ import annotations

import pytest
import torch

from experiments.rl.algorithms.advantages import gae, grpo_advantages
from experiments.rl.algorithms.ppo import kl_penalty, ppo_policy_loss


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


def test_ppo_loss_on_policy_is_minus_mean_advantage():
    logp = torch.randn(3, 5)
    adv = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    loss, stats = ppo_policy_loss(logp, logp.clone(), adv, mask)
    assert torch.allclose(loss, -adv.mean(), atol=1e-6)
    assert stats["clip_fraction"] == 0.0


def test_ppo_clipping_stops_the_gradient():
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])  # ratio e^0.5 > 1.2 with A>0; e^-0.5 < 0.8 with A<0
    loss, stats = ppo_policy_loss(logp, old, adv, torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert torch.all(logp.grad == 0) and stats["clip_fraction"] == 1.0


def test_decoupled_ppo():
    torch.manual_seed(1)
    logp, old, adv, mask = torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3), torch.ones(4, 3)
    standard, _ = ppo_policy_loss(logp, old, adv, mask)
    same, _ = ppo_policy_loss(logp, old, adv, mask, prox_logp=old.clone())
    assert torch.allclose(standard, same)
    prox = old + 1.0  # proximal policy far above behaviour: weights e^1 > cap -> masked out
    capped, stats = ppo_policy_loss(logp, old, adv, mask, prox_logp=prox, behav_imp_weight_cap=2.0)
    assert capped.item() == 0.0 and stats["behav_weight_mean"] == 0.0


def test_kl_penalty():
    a, b = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    assert torch.all(kl_penalty(a, a) == 0)
    assert torch.all(kl_penalty(a, b, "k3") >= 0)
    with pytest.raises(ValueError):
        kl_penalty(a, b, "k4")
