"""Sampling temperature in the trainer's log-probs (pure).

A rollout sampled at temperature ``T`` draws each token from ``softmax(z / T)``, and vLLM (with
``logprobs_mode=processed_logprobs``) reports that distribution's log-prob. The loss compares
those with the trainer's log-probs, so the trainer divides its logits by the same ``T`` at the
same positions (as verl and AReaL do). Temperatures travel per sequence as the temperatures of
its *last* ``len(t)`` next-token positions (its completion's tokens); every other position, and
every position of a sequence that carries none, is at 1.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


Temperatures = Optional[Sequence[Optional[torch.Tensor]]]
"""Per sequence: the temperatures of its last ``len(t)`` next-token positions (None or empty:
all 1); None: every sequence at 1."""


def position_temperatures(lens: Sequence[int], temps: Temperatures,
                          width: int, device: torch.device | str = "cpu"
                          ) -> torch.Tensor | None:
    """The ``[len(lens), width]`` temperatures of a padded batch's next-token positions (row
    ``i`` has ``lens[i] - 1`` of them): each row's last ``len(temps[i])`` positions take
    ``temps[i]``, the rest 1. None when no row carries a temperature other than 1 (the logits
    are then used as they are)."""
    if temps is None or all(t is None or len(t) == 0 or bool((t == 1).all()) for t in temps):
        return None
    out = torch.ones(len(lens), width, dtype=torch.float32)
    for row, (n, t) in enumerate(zip(lens, temps)):
        if t is None or len(t) == 0:
            continue
        if len(t) > n - 1:
            raise ValueError(f"{len(t)} temperatures for a sequence of {n} tokens (at most "
                             f"{n - 1} next-token positions)")
        out[row, n - 1 - len(t):n - 1] = torch.as_tensor(t, dtype=torch.float32)
    return out.to(device)


def tempered(logits: torch.Tensor, temps: torch.Tensor | None, in_place: bool = True
             ) -> torch.Tensor:
    """``logits`` (``[batch, positions, vocab]``) divided by each position's temperature
    (``[batch, positions]``; None: as they are), in place by default: they are a step's
    largest tensor, and no copy of them is kept (autograd keeps the divisor, not the
    dividend). ``in_place=False`` where autograd forbids it (a view of a custom Function's
    output, as megatron's gather returns at tp=1)."""
    if temps is None:
        return logits
    t = temps[..., None].to(logits.dtype)
    return logits.div_(t) if in_place else logits / t
