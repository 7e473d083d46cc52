"""Loss aggregation: how the token losses of a batch make its loss (numpy, on the master).

The engines divide the summed token losses of the whole batch by its token count
(``global_tokens``), which is the token mean (a batch here is what one optimizer step trains
on: a mini-batch with ``rl.ppo_minibatches``). The other aggregations are that sum with a
weight per sequence, the same on every token of it, so that the division gives them:

- ``token-mean``: every token weighs the same (no weights);
- ``seq-mean-token-mean``: ``T / (S * L_i)``, each sequence's token mean averaged over the
  ``S`` sequences (GRPO's paper; a long completion weighs no more than a short one);
- ``seq-mean-token-sum``: ``T / S``, each sequence's token sum averaged;
- ``seq-mean-token-sum-norm``: ``T / (S * C)``, the token sums over ``S`` times a constant
  ``C`` (``rl.agent.max_new_tokens``; Dr. GRPO: no length bias, whatever the lengths).

``T`` is the batch's token count, ``L_i`` sequence ``i``'s (its loss tokens, the mask's sum),
``S`` the number of sequences with a loss token (one without gets weight 0). A sequence is a
session: an agent's session that split into several trajectories (``session`` keys) counts
once, its tokens those of all its trajectories, as GRPO's advantages count it.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np


def loss_weights(masks: Sequence[np.ndarray], aggregation: str, norm: int,
                 sessions: Sequence[Hashable] | None = None) -> list[np.ndarray] | None:
    """Per-token weights of every trajectory (``masks``: its loss tokens), or None for
    ``token-mean``. ``norm``: the constant of ``seq-mean-token-sum-norm``; ``sessions``: each
    trajectory's session (None: each its own)."""
    if aggregation == "token-mean":
        return None
    keys = list(range(len(masks))) if sessions is None else list(sessions)
    if len(keys) != len(masks):
        raise ValueError(f"{len(keys)} session keys for {len(masks)} trajectories")
    length: dict[Hashable, float] = {}
    for k, m in zip(keys, masks):
        length[k] = length.get(k, 0.0) + float(np.asarray(m, np.float64).sum())
    total = sum(length.values())
    count = max(sum(1 for v in length.values() if v > 0), 1)
    if aggregation == "seq-mean-token-mean":
        per = {k: total / (count * v) if v > 0 else 0.0 for k, v in length.items()}
    elif aggregation == "seq-mean-token-sum":
        per = {k: total / count for k in length}
    elif aggregation == "seq-mean-token-sum-norm":
        if norm < 1:
            raise ValueError(f"seq-mean-token-sum-norm needs a normaliser >= 1, got {norm}")
        per = {k: total / (count * norm) for k in length}
    else:
        raise ValueError(f"aggregation {aggregation!r} is not known")
    return [np.full(len(m), per[k], np.float32) for m, k in zip(masks, keys)]
