"""What the generation loop keeps of each request (its samples and their tokens, log-probs and
weight versions) and the pure helpers that shape its answer."""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import numpy as np

from workers.engines.output_stream import OutputStream
from workers.engines.vllm_config import Sampling


@dataclasses.dataclass
class _Seq:
    sid: int
    prompt: list[int]
    sampling: Sampling
    group: "_Group"
    index: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rid: str = ""
    segments: int = 0
    finish: str = ""


@dataclasses.dataclass
class _Group:
    future: Future
    seqs: list[_Seq]
    left: int
    submitted: float
    stream: OutputStream | None = None


def _top(position: dict[int, Any], k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(token id, logprob)`` of one position of vLLM's logprobs (which
    also holds the sampled token, whatever its rank)."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank else 1 << 62)
    return tuple((int(t), float(lp.logprob)) for t, lp in ranked[:k])


def segments_of(versions: np.ndarray) -> list[list[int]]:
    """``[[version, count], ...]`` runs of equal versions."""
    out: list[list[int]] = []
    for v in versions.tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out
