"""Loss aggregation: how the token losses of a batch make its loss (numpy, on the master).

The engines divide the summed token losses of the whole batch by its token count
(``global_tokens``), which is the token mean. The other aggregations are that sum with a
weight per sequence, the same on every token of it, so that the division gives them:

- ``token-mean``: every token weighs the same (no weights);
- ``seq-mean-token-mean``: ``T / (S * L_i)``, each sequence's token mean averaged over the
  ``S`` sequences (GRPO's paper; a long completion weighs no more than a short one);
- ``seq-mean-token-sum``: ``T / S``, each sequence's token sum averaged;
- ``seq-mean-token-sum-norm``: ``T / (S * C)``, the token sums over ``S`` times a constant
  ``C`` (``rl.agent.max_new_tokens``; Dr. GRPO: no length bias, whatever the lengths).

``T`` is the batch's token count, ``L_i`` sequence ``i``'s (its loss tokens, the mask's sum).
A sequence without a loss token gets weight 0.
"""
from __future__ import annotations

import numpy as np


def loss_weights(masks: list[np.ndarray], aggregation: str, norm: int) -> list[np.ndarray] | None:
    """Per-token weights of every sequence (``masks``: its loss tokens), or None for
    ``token-mean``. ``norm``: the constant of ``seq-mean-token-sum-norm``."""
    if aggregation == "token-mean":
        return None
    lengths = np.asarray([float(np.asarray(m, np.float64).sum()) for m in masks])
    total, count = float(lengths.sum()), max(len(masks), 1)
    if aggregation == "seq-mean-token-mean":
        per_seq = np.divide(total, count * lengths, out=np.zeros_like(lengths),
                            where=lengths > 0)
    elif aggregation == "seq-mean-token-sum":
        per_seq = np.full_like(lengths, total / count)
    elif aggregation == "seq-mean-token-sum-norm":
        if norm < 1:
            raise ValueError(f"seq-mean-token-sum-norm needs a normaliser >= 1, got {norm}")
        per_seq = np.full_like(lengths, total / (count * norm))
    else:
        raise ValueError(f"aggregation {aggregation!r} is not known")
    return [np.full(len(m), w, np.float32) for m, w in zip(masks, per_seq)]
