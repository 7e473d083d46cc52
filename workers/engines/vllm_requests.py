"""What the generation loop keeps of each request (its samples and their tokens, log-probs and
weight versions) and the pure helpers that shape its answer."""
from __future__ import annotations

import dataclasses
import hashlib
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


LOGPROB_FLOOR = -9999.0
"""Alternatives outside a ``top_p`` nucleus have log-prob -inf in the sampled distribution;
they are reported at this floor, as OpenAI and vLLM's own server do (JSON has no infinity)."""


def _top(position: dict[int, Any], k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely ``(token id, logprob)`` of one position of vLLM's logprobs (which
    also holds the sampled token, whatever its rank), none under :data:`LOGPROB_FLOOR`."""
    ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank else 1 << 62)
    return tuple((int(t), max(float(lp.logprob), LOGPROB_FLOOR)) for t, lp in ranked[:k])


def segments_of(versions: np.ndarray) -> list[list[int]]:
    """``[[version, count], ...]`` runs of equal versions."""
    out: list[list[int]] = []
    for v in versions.tolist():
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def segment_seed(seed: int | None, index: int, done: int) -> int | None:
    """The sampling seed of sample ``index`` of a request seeded ``seed`` (None: unseeded),
    resumed after ``done`` tokens (pure). The first segment uses ``seed + index``; one that
    continues a sample after a weight update gets a seed hashed from that and ``done``, so its
    tokens do not draw the same random numbers as the sample's first ones did."""
    if seed is None:
        return None
    first = (seed + index) % (1 << 63)
    if done == 0:
        return first
    digest = hashlib.blake2b(f"{first}:{done}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def vllm_request(seq: _Seq, eos: int | None) -> tuple[Any, Any]:
    """vLLM's prompt and sampling parameters for what is left of ``seq`` (its prompt and the
    tokens so far: a sample cut at an update continues there, with a seed of its own)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    s = seq.sampling
    stop = list(s.stop_token_ids) + ([eos] if eos is not None and not s.ignore_eos else [])
    params = SamplingParams(max_tokens=s.max_tokens - len(seq.tokens), temperature=s.temperature,
                            top_p=s.top_p, stop_token_ids=stop or None, logprobs=s.top_logprobs,
                            detokenize=False, ignore_eos=s.ignore_eos,
                            seed=segment_seed(s.seed, seq.index, len(seq.tokens)),
                            output_kind=RequestOutputKind.DELTA)
    return TokensPrompt(prompt_token_ids=seq.prompt + seq.tokens), params
