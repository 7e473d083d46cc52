"""The trainer's log-probs at the rollouts' sampling temperatures: placed at each sequence's
last positions (its completion), the logits divided there, in ``logprobs`` and in the
log-probs a training step's loss gets; a batch at 1 runs the logits as they are."""
from __future__ import annotations

import pytest
import torch

from workers.engines.temperature import position_temperatures, tempered
from workers.engines.torch_engine import TorchEngine, TorchEngineConfig


def test_temperatures_go_to_each_rows_last_positions_and_the_rest_stay_at_1():
    got = position_temperatures([5, 3, 6], [torch.tensor([0.5, 2.0]), None, torch.tensor([])],
                                width=5)
    assert got is not None and got.shape == (3, 5)
    # row 0: 4 next-token positions, the last 2 tempered; the padding past them stays 1
    assert got.tolist() == [[1, 1, 0.5, 2.0, 1], [1] * 5, [1] * 5]
    assert position_temperatures([5, 3], None, width=4) is None
    assert position_temperatures([5, 3], [torch.ones(2), None], width=4) is None  # all at 1
    with pytest.raises(ValueError, match="3 temperatures for a sequence of 3 tokens"):
        position_temperatures([3], [torch.tensor([0.5, 0.5, 0.5])], width=2)
    logits = torch.randn(3, 5, 7)
    assert tempered(logits, None) is logits
    want = logits[0, 2] / 0.5
    assert torch.equal(tempered(logits, got)[0, 2], want)


def test_tempering_in_place_gives_the_gradient_of_the_division():
    """The logits are divided in place (no copy of the largest tensor): autograd's gradient is
    the out-of-place division's."""
    torch.manual_seed(0)
    x, temps = torch.randn(2, 4, 8), torch.tensor([[1.0, 0.5, 2.0, 1.0], [0.7, 1.0, 1.0, 3.0]])
    grads, w0 = [], torch.randn(8, 16)
    for in_place in (True, False):
        w = w0.clone().requires_grad_()
        logits = x @ w
        z = tempered(logits, temps) if in_place else logits / temps[..., None]
        torch.log_softmax(z, -1)[..., 3].sum().backward()
        grads.append(w.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # a small micro-batch budget: sequences at different temperatures share and split batches
    return TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, max_tokens_per_microbatch=30))


def _seqs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 128, (n,), generator=g) for n in (9, 14, 6, 11)]


def _want(engine: TorchEngine, s: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """The log-probs by hand: a plain forward, the last len(t) positions' logits divided."""
    with torch.no_grad():
        logits = engine.model(input_ids=s[None]).logits[0, :-1].float()
    if t is not None:
        logits[len(logits) - len(t):] /= t[:, None]
    return torch.log_softmax(logits, -1).gather(1, s[1:, None])[:, 0]


TEMPS = [torch.tensor([0.6, 0.6, 0.6]), None, torch.tensor([1.7, 1.7]), torch.tensor([])]


def test_logprobs_divide_the_completions_logits_by_their_temperature(engine):
    seqs = _seqs()
    got = engine.logprobs(seqs, TEMPS)
    plain = engine.logprobs(seqs)
    for s, t, lp, p in zip(seqs, TEMPS, got, plain):
        assert torch.allclose(lp, _want(engine, s, t), atol=1e-5)
        k = len(s) - 1 - (0 if t is None else len(t))
        assert torch.equal(lp[:k], p[:k])  # the prompt's positions are at 1
        if t is not None and len(t):
            assert (lp[k:] - p[k:]).abs().max() > 1e-3


def test_a_training_steps_loss_gets_the_tempered_logprobs(engine):
    seqs = _seqs()
    want = engine.logprobs(seqs, TEMPS)
    seen: dict[int, torch.Tensor] = {}

    def loss(lps: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
        for i, lp in zip(idx, lps):
            seen[i] = lp.detach().clone()
        return sum(lp.sum() for lp in lps) * 0.0  # (no update: the weights stay)

    engine.train_step(seqs, loss, global_tokens=10, temps=TEMPS)
    assert sorted(seen) == [0, 1, 2, 3]
    for i, lp in seen.items():
        assert torch.allclose(lp, want[i], atol=1e-5), i
