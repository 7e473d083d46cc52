"""An OpenAI-compatible HTTP endpoint on a generation server, for external agents.

``GET /v1/models``, ``POST /v1/completions`` (``prompt``: text or token ids) and
``POST /v1/chat/completions`` (the tokenizer's chat template). Requests go to the same engine
as our RPC path, so they share its continuous batch and its weight versions; every choice says
which versions produced its tokens (``weight_versions``), an extension to the OpenAI schema.

Served by :class:`~workers.engines.http_server.JsonHttpServer`: every request needs the trial's
API key, and connections, time, memory and samples per request are bounded
(:class:`~workers.engines.http_server.HttpLimits`). What a client sees: 200, or a JSON error
with 400 (an invalid request), 401 (no or a wrong key), 404/405, 408 (too slow), 411/413 (no or
too large a ``Content-Length``), 429 (too many connections), 503 (the engine is down) or 504.
"""
from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from system.errors import ConfigError
from workers.engines.http_server import HttpError, HttpLimits, JsonHttpServer
from workers.engines.openai_request import (GenerationRequest, chat_messages, completion_prompt,
                                            generation_request)
from workers.engines.vllm_server import GenerationEngine


class OpenAIEndpoint:
    """The routes (a :class:`~workers.engines.http_server.JsonApp`) and their server thread."""

    def __init__(self, engine: GenerationEngine, tokenizer: Any, model_name: str, host: str,
                 api_key: str, limits: HttpLimits | None = None, port: int = 0) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.limits = limits or HttpLimits()
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not re-entrant
        self.server = JsonHttpServer(host, port, self, api_key, self.limits)
        self.address = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="openai-http",
                                        daemon=True)
        self._thread.start()

    def handle(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        route = path.split("?", 1)[0].rstrip("/")
        routes = {"/v1/models": ("GET", self.models), "/v1/completions": ("POST", self.completions),
                  "/v1/chat/completions": ("POST", self.chat)}
        if route not in routes:
            raise HttpError(404, f"no route {route[:100]!r}")
        want, fn = routes[route]
        if method != want:
            raise HttpError(405, f"{route} takes {want}", {"Allow": want})
        try:
            return fn(body or {})
        except ConfigError as e:
            raise HttpError(400, str(e)) from None

    def models(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "rlsys"}]}

    def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        req = generation_request(body, self.limits.max_n)
        prompt = completion_prompt(body)
        ids = self._encode(prompt) if isinstance(prompt, str) else prompt
        samples = self._run(ids, req)
        choices = []
        for i, s in enumerate(samples):
            tokens = [int(t) for t in s["tokens"]]
            choice = {"index": i, "text": self._decode(tokens), "finish_reason": s["finish"],
                      "weight_versions": s["segments"]}
            if req.logprobs:
                with self._tokenizer_lock:
                    pieces = [self.tokenizer.decode([t]) for t in tokens]
                choice["logprobs"] = {"tokens": pieces, "token_ids": tokens,
                                      "token_logprobs": [float(x) for x in s["logprobs"]]}
            choices.append(choice)
        return self._envelope("text_completion", choices, len(ids), samples)

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        req = generation_request(body, self.limits.max_n)
        ids = self._chat_ids(chat_messages(body))
        samples = self._run(ids, req)
        choices = [{"index": i, "message": {"role": "assistant",
                                            "content": self._decode([int(t) for t in s["tokens"]])},
                    "finish_reason": s["finish"], "weight_versions": s["segments"]}
                   for i, s in enumerate(samples)]
        return self._envelope("chat.completion", choices, len(ids), samples)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):  # plain concatenation
            return self._encode("".join(m["content"] for m in messages))
        try:
            with self._tokenizer_lock:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=True)
        except Exception as e:  # the template refused these messages (jinja raised)
            raise ConfigError(f"messages: the chat template failed: {type(e).__name__}: "
                              f"{str(e)[:200]}") from None
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _run(self, ids: list[int], req: GenerationRequest) -> list[dict[str, Any]]:
        """Submit to the engine and wait; its refusals and failures as HTTP errors."""
        from vllm.exceptions import VLLMClientError

        try:
            future = self.engine.submit(ids, req.n, req.sampling)
        except RuntimeError as e:  # GenerationLoopDied, or the engine is stopping
            raise HttpError(503, f"the generation engine is not serving: {e}") from None
        try:
            return future.result(self.limits.request_timeout)
        except FutureTimeout:
            raise HttpError(504, f"no answer within {self.limits.request_timeout:g} s") from None
        except (ConfigError, VLLMClientError, ValueError, TypeError) as e:  # refused in the loop
            raise HttpError(400, f"{type(e).__name__}: {str(e)[:500]}") from None
        except RuntimeError as e:
            raise HttpError(503, f"the generation engine failed: {e}") from None

    def _encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text))

    def _decode(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _envelope(self, obj: str, choices: list, plen: int,
                  samples: list[dict[str, Any]]) -> dict[str, Any]:
        completion = sum(len(s["tokens"]) for s in samples)
        return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": obj, "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": plen, "completion_tokens": completion,
                          "total_tokens": plen + completion}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
