"""The PPO objective and the KL penalty."""
from __future__ import annotations

import pytest
import torch

from experiments.rl.algorithms.ppo import kl_penalty, ppo_policy_loss


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
