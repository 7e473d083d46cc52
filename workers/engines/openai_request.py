"""Reading an OpenAI request body into what the engine takes, refusing anything else.

Strict on purpose (the endpoint faces other users of the cluster): integers are integers (not
floats, strings or booleans), numbers are finite, ``n`` is bounded, and a feature we do not
implement (``stream``, ``stop`` strings) is refused rather than silently ignored. Fields of the
OpenAI schema we do not use (``model``, ``user``, ...) are ignored. Token ids are checked against
the vocabulary and lengths against ``max_model_len`` by the engine's ``submit``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from system.errors import ConfigError
from workers.engines.vllm_config import Sampling, as_int

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions."""
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclasses.dataclass
class GenerationRequest:
    """The engine's part of one request."""

    n: int
    sampling: Sampling
    logprobs: bool


def _field(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def generation_request(body: dict[str, Any], max_n: int) -> GenerationRequest:
    """``n``, the sampling parameters and ``logprobs`` of ``body``
    (:class:`~system.errors.ConfigError` naming the field that is wrong)."""
    if _field(body, "stream", False) is not False:
        raise ConfigError("stream is not supported: leave it out or false")
    if _field(body, "stop", None):
        raise ConfigError("stop strings are not supported: use stop_token_ids")
    n = as_int("n", _field(body, "n", 1), lo=1)
    if n > max_n:
        raise ConfigError(f"n must be <= {max_n}, got {n}")
    stop = _field(body, "stop_token_ids", [])
    if not isinstance(stop, list):
        raise ConfigError("stop_token_ids must be a list of token ids")
    sampling = Sampling(max_tokens=_field(body, "max_tokens", DEFAULT_MAX_TOKENS),
                        temperature=_field(body, "temperature", 1.0),
                        top_p=_field(body, "top_p", 1.0), stop_token_ids=tuple(stop),
                        ignore_eos=_field(body, "ignore_eos", False))
    logprobs = _field(body, "logprobs", None)
    if logprobs is not None and not isinstance(logprobs, (bool, int)):
        raise ConfigError("logprobs must be an integer or a boolean")
    return GenerationRequest(n, sampling, logprobs is not None and logprobs is not False)


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


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """The ``messages`` of a chat completion, each ``{"role", "content"}`` with text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"messages[{i}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ConfigError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out
