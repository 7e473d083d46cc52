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


def test_a_log_ratio_beyond_the_bound_gives_a_finite_loss_and_no_gradient_through_it():
    """Log-probs 200 apart (exp overflows float32 at 89): the ratio and the behaviour weight are
    clamped at e^20, the loss and every gradient stay finite (before: inf, then NaN weights;
    the weight's size is behav_imp_weight_cap's to bound)."""
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-201.0, -1.0]])
    for prox in (None, torch.tensor([[-1.0, -1.0]])):
        loss, stats = ppo_policy_loss(logp, old, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2),
                                      prox_logp=prox, behav_imp_weight_cap=None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all(), (loss, logp.grad)
        assert all(v == v for v in stats.values())  # (no NaN)
        if prox is None:  # the clamped ratio passes no gradient
            assert logp.grad[0, 0] == 0
        logp.grad = None


def test_clip_higher_lets_a_positive_advantage_raise_the_ratio_further():
    """ratio 1.25, A > 0: clipped (no gradient) at the symmetric 0.2, not at clip_eps_high
    0.28; the lower clip stays 0.2 (ratio 0.75 with A < 0 is clipped either way)."""
    for high, grad in ((None, False), (0.28, True)):
        logp = torch.log(torch.tensor([[1.25, 0.75]])).requires_grad_()
        loss, stats = ppo_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]),
                                      torch.ones(1, 2), clip_eps=0.2, clip_eps_high=high)
        loss.backward()
        assert bool(logp.grad[0, 0] != 0) is grad and logp.grad[0, 1] == 0
        assert stats["clip_fraction"] == (0.5 if grad else 1.0)


def test_dual_clip_bounds_the_loss_of_a_negative_advantage():
    """ratio 5 under A = -1: the loss is 5 (and pushes the ratio down) without dual clip, at
    most 3 and without gradient with dual_clip=3; a positive advantage is not touched."""
    logp = torch.log(torch.tensor([[5.0, 1.1]])).requires_grad_()
    old, adv, mask = torch.zeros(1, 2), torch.tensor([[-1.0, 2.0]]), torch.ones(1, 2)
    plain, _ = ppo_policy_loss(logp, old, adv, mask)
    assert plain.item() == pytest.approx((5.0 - 2.2) / 2)
    logp.grad = None
    dual, stats = ppo_policy_loss(logp, old, adv, mask, dual_clip=3.0)
    dual.backward()
    assert dual.item() == pytest.approx((3.0 - 2.2) / 2)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    assert stats["dual_clip_fraction"] == 0.5


def test_token_weights_scale_each_terms_share():
    torch.manual_seed(2)
    logp, old, adv = torch.randn(1, 4), torch.randn(1, 4), torch.randn(1, 4)
    mask, w = torch.tensor([[1.0, 1.0, 0.0, 1.0]]), torch.tensor([[2.0, 0.5, 9.0, 1.0]])
    each = [ppo_policy_loss(logp[:, i:i + 1], old[:, i:i + 1], adv[:, i:i + 1],
                            mask[:, i:i + 1])[0] for i in range(4)]
    weighted, _ = ppo_policy_loss(logp, old, adv, mask, weights=w)
    want = sum(float(w[0, i] * each[i]) for i in (0, 1, 3)) / 3
    assert weighted.item() == pytest.approx(want, rel=1e-5)


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
