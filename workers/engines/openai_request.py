"""Reading an OpenAI request body into what the engine takes, refusing anything else.

Strict on purpose (the endpoint faces other users of the cluster): integers are integers (not
floats, strings or booleans), numbers are finite, ``n`` and ``stop`` are bounded, and a feature we
do not implement (``echo``, ``logit_bias``, penalties, ``response_format``, a forced
``tool_choice``) is refused rather than silently ignored. Fields of the OpenAI schema that do not
change what is generated (``model``, ``user``, ``parallel_tool_calls``, ...) are ignored. Token
ids are checked against the vocabulary and lengths against ``max_model_len`` by the engine's
``submit``; messages and tools are checked here, and by the chat template
(:mod:`workers.engines.openai_chat`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from system.errors import ConfigError
from workers.engines.vllm_config import MAX_TOP_LOGPROBS, Sampling, as_int

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions."""
MAX_STOP = 4
"""Most stop strings per request (OpenAI's bound)."""
MAX_STOP_CHARS = 256
"""Longest stop string."""
STREAM_OPTIONS = ("include_usage",)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """The engine's part of one request, and how to answer it."""

    n: int
    sampling: Sampling
    logprobs: bool
    """Return the log-probability of every generated token."""
    top_logprobs: int
    """... and of this many most likely tokens at each position."""
    stream: bool = False
    """Answer with server-sent events as tokens come."""
    include_usage: bool = False
    """Streaming: a last chunk with ``usage`` (``stream_options.include_usage``)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a sample ends before the first of them (which is not returned)."""


def _field(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _flag(body: dict[str, Any], key: str) -> bool:
    value = _field(body, key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {str(value)[:40]!r}")
    return value


def completion_request(body: dict[str, Any], max_n: int) -> GenerationRequest:
    """A ``/v1/completions`` body: ``logprobs`` is a count of alternatives per token (0: the
    sampled token's only; ``true`` counts as 0)."""
    if _flag(body, "echo"):
        raise ConfigError("echo is not supported: leave it out or false")
    if _field(body, "suffix", ""):
        raise ConfigError("suffix is not supported: leave it out")
    logprobs = _field(body, "logprobs", None)
    if logprobs is None or logprobs is False:
        return _request(body, max_n, False, 0, DEFAULT_MAX_TOKENS)
    top = 0 if logprobs is True else _top_count("logprobs", logprobs)
    return _request(body, max_n, True, top, DEFAULT_MAX_TOKENS)


def chat_request(body: dict[str, Any], max_n: int, max_tokens: int) -> GenerationRequest:
    """A ``/v1/chat/completions`` body: ``logprobs`` true/false, ``top_logprobs`` a count;
    ``max_completion_tokens`` is the newer name of ``max_tokens`` (default: ``max_tokens``,
    what the context leaves)."""
    logprobs = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not logprobs:
        raise ConfigError("top_logprobs needs logprobs: true")
    top = 0 if top is None else _top_count("top_logprobs", top)
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise ConfigError(f"{key} is not supported: use tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ConfigError("response_format is not supported: leave it out or {\"type\": \"text\"}")
    a, b = body.get("max_tokens"), body.get("max_completion_tokens")
    if a is not None and b is not None and a != b:
        raise ConfigError("max_tokens and max_completion_tokens differ: give one of them")
    return _request(body, max_n, logprobs, top, max_tokens, a if a is not None else b)


def _top_count(key: str, value: Any) -> int:
    top = as_int(key, value, lo=0)
    if top > MAX_TOP_LOGPROBS:
        raise ConfigError(f"{key} must be <= {MAX_TOP_LOGPROBS}, got {top}")
    return top


def _request(body: dict[str, Any], max_n: int, logprobs: bool, top: int, default_max: int,
             max_tokens: Any = None) -> GenerationRequest:
    n = as_int("n", _field(body, "n", 1), lo=1)
    if n > max_n:
        raise ConfigError(f"n must be <= {max_n}, got {n}")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise ConfigError("best_of is not supported: leave it out or equal to n")
    _refuse_unsupported(body)
    stream = _flag(body, "stream")
    include_usage = _stream_options(body.get("stream_options"), stream)
    stop_ids = _field(body, "stop_token_ids", [])
    if not isinstance(stop_ids, list):
        raise ConfigError("stop_token_ids must be a list of token ids")
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", default_max)
    sampling = Sampling(max_tokens=max_tokens,
                        temperature=_field(body, "temperature", 1.0),
                        top_p=_field(body, "top_p", 1.0), stop_token_ids=tuple(stop_ids),
                        ignore_eos=_field(body, "ignore_eos", False),
                        top_logprobs=top, seed=body.get("seed"))
    return GenerationRequest(n, sampling, logprobs, top, stream, include_usage,
                             stop_strings(body.get("stop")))


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        value = body.get(key)
        if value is not None and value != 0:
            raise ConfigError(f"{key} is not supported: leave it out or 0")
    if body.get("logit_bias"):
        raise ConfigError("logit_bias is not supported: leave it out")


def _stream_options(options: Any, stream: bool) -> bool:
    """``include_usage`` of ``stream_options`` (only with ``stream: true``)."""
    if options is None:
        return False
    if not stream:
        raise ConfigError("stream_options needs stream: true")
    if not isinstance(options, dict):
        raise ConfigError("stream_options must be an object")
    unknown = sorted(set(options) - set(STREAM_OPTIONS))
    if unknown:
        raise ConfigError(f"stream_options: {str(unknown[0])[:40]!r} is not supported (valid: "
                          f"{', '.join(STREAM_OPTIONS)})")
    return _flag(options, "include_usage")


def stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop``: one string or a list of at most :data:`MAX_STOP` non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ConfigError("stop must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise ConfigError(f"stop: at most {MAX_STOP} strings, got {len(items)}")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ConfigError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(items)


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The ``prompt`` of a completion: one text or one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError("prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        return [as_int("prompt token ids", t) for t in prompt]
    raise ConfigError("prompt must be a non-empty string or a non-empty list of token ids")
