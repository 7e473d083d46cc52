"""An OpenAI-compatible HTTP endpoint on a generation server, for external agents.

``GET /v1/models``, ``POST /v1/completions`` (``prompt``: text or token ids) and
``POST /v1/chat/completions`` (the tokenizer's chat template, with ``tools`` where the template
takes them). Both generation routes take ``n`` (bounded), ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop`` (up to 4 strings) and ``stop_token_ids``, return ``logprobs``
(completions: a count of alternatives; chat: ``logprobs`` + ``top_logprobs``) and ``usage``, and
stream with ``stream: true`` (server-sent events; ``stream_options.include_usage`` adds a last
chunk with ``usage``). Requests go to the same engine as our RPC path, so they share its
continuous batch and its weight versions; every choice says which versions produced its tokens
(``weight_versions``), an extension to the OpenAI schema.

Served by :class:`~workers.engines.http_server.JsonHttpServer`: every request needs the trial's
API key, and connections, time, memory and samples per request are bounded
(:class:`~workers.engines.http_server.HttpLimits`). What a client sees: 200, or a JSON error
with 400 (an invalid request), 401 (no or a wrong key), 404/405, 408 (too slow), 411/413 (no or
too large a ``Content-Length``), 429 (too many connections), 503 (the engine is down) or 504.
A streamed answer that fails after its first chunk ends with an event ``{"error": ...}``.

Agent sessions: the same routes under ``/sessions/<id>/v1/...`` (a client whose ``base_url`` is
``<address>/sessions/<id>/v1``) are recorded for training
(:mod:`workers.engines.openai_sessions`); a request the session bounds refuse is answered 400
(the session's own caps) or 429 (the store is full).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Iterator

from system.errors import ConfigError
from workers.engines.http_server import EventStream, HttpError, HttpLimits, JsonHttpServer
from workers.engines.openai_chat import chat_messages, chat_tools, render_chat
from workers.engines.openai_generation import ChoiceEvent, Generation, gather
from workers.engines.openai_request import (GenerationRequest, chat_request, completion_prompt,
                                            completion_request)
from workers.engines.openai_sessions import SESSION_ID, SessionRefused, SessionStore
from workers.engines.openai_text import chat_logprobs, completion_logprobs
from workers.engines.vllm_server import GenerationEngine


class OpenAIEndpoint:
    """The routes (a :class:`~workers.engines.http_server.JsonApp`) and their server thread."""

    def __init__(self, engine: GenerationEngine, tokenizer: Any, model_name: str, host: str,
                 api_key: str, limits: HttpLimits | None = None, port: int = 0,
                 sessions: SessionStore | None = None) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.limits = limits or HttpLimits()
        self.sessions = sessions or SessionStore()
        """The agent sessions recorded for training (see the module's docstring)."""
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not re-entrant
        self.server = JsonHttpServer(host, port, self, api_key, self.limits)
        self.address = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="openai-http",
                                        daemon=True)
        self._thread.start()

    def handle(self, method: str, path: str, body: dict[str, Any] | None
               ) -> dict[str, Any] | EventStream:
        route, session = _session_route(path.split("?", 1)[0].rstrip("/"))
        routes = {"/v1/models": ("GET", self.models), "/v1/completions": ("POST", self.completions),
                  "/v1/chat/completions": ("POST", self.chat)}
        if route not in routes:
            raise HttpError(404, f"no route {route[:100]!r}")
        want, fn = routes[route]
        if method != want:
            raise HttpError(405, f"{route} takes {want}", {"Allow": want})
        try:
            return fn(body or {}, session)
        except ConfigError as e:
            raise HttpError(400, str(e)) from None
        except SessionRefused as e:
            raise HttpError(e.status, str(e)) from None

    def models(self, body: dict[str, Any], session: str | None = None) -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "rlsys"}]}

    # --- completions ---
    def completions(self, body: dict[str, Any], session: str | None = None
                    ) -> dict[str, Any] | EventStream:
        req = completion_request(body, self.limits.max_n)
        prompt = completion_prompt(body)
        ids = self._encode(prompt) if isinstance(prompt, str) else prompt
        gen = self._start(ids, req, session)
        if req.stream:
            return self._stream(gen, "text_completion", self._completion_chunk)
        choices = []
        for i, c in enumerate(gather(gen)):
            choice = {"index": i, "text": c["text"], "finish_reason": c["finish"],
                      "weight_versions": c["versions"], "logprobs": None}
            if req.logprobs:
                choice["logprobs"] = completion_logprobs(
                    self._pieces, tuple(c["token_ids"]), tuple(c["logprobs"]),
                    tuple(c["top_logprobs"]), req.top_logprobs > 0, 0)
            choices.append(choice)
        return self._envelope("text_completion", choices, gen)

    def _completion_chunk(self, gen: Generation, ev: ChoiceEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": ev.index, "text": ev.text, "logprobs": None,
                                  "finish_reason": ev.finish}
        if gen.req.logprobs:
            offset = len(gen.texts[ev.index].text) - len(ev.text)
            choice["logprobs"] = completion_logprobs(
                self._pieces, ev.token_ids, ev.logprobs, ev.top_logprobs,
                gen.req.top_logprobs > 0, offset)
        if ev.finish is not None:
            choice["weight_versions"] = gen.versions[ev.index]
        return choice

    # --- chat ---
    def chat(self, body: dict[str, Any], session: str | None = None
             ) -> dict[str, Any] | EventStream:
        messages, tools = chat_messages(body), chat_tools(body)
        with self._tokenizer_lock:
            ids = render_chat(self.tokenizer, messages, tools)
        room = max(1, self.engine.cfg.max_model_len - len(ids))
        req = chat_request(body, self.limits.max_n, room)
        gen = self._start(ids, req, session)
        if req.stream:
            return self._stream(gen, "chat.completion.chunk", self._chat_chunk)
        choices = []
        for i, c in enumerate(gather(gen)):
            choices.append({
                "index": i, "message": {"role": "assistant", "content": c["text"]},
                "finish_reason": c["finish"], "weight_versions": c["versions"],
                "logprobs": chat_logprobs(self._pieces, tuple(c["token_ids"]),
                                          tuple(c["logprobs"]), tuple(c["top_logprobs"]))
                if req.logprobs else None})
        return self._envelope("chat.completion", choices, gen)

    def _chat_chunk(self, gen: Generation, ev: ChoiceEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": ev.index, "delta": {"content": ev.text},
                                  "logprobs": None, "finish_reason": ev.finish}
        if gen.req.logprobs:
            choice["logprobs"] = chat_logprobs(self._pieces, ev.token_ids, ev.logprobs,
                                               ev.top_logprobs)
        if ev.finish is not None:
            choice["weight_versions"] = gen.versions[ev.index]
        return choice

    # --- shared ---
    def _start(self, ids: list[int], req: GenerationRequest, session: str | None) -> Generation:
        """Submit; a session's request is first admitted by the session store (which may
        refuse it) and its choices are recorded as they finish."""
        record = None
        if session is not None:
            record = self.sessions.admit(session, len(ids), req.n, int(req.sampling.max_tokens))
        try:
            return Generation(self.engine, ids, req, self._decode, self.limits.request_timeout,
                              record)
        except BaseException:
            if record is not None:
                record.release()
            raise

    def _stream(self, gen: Generation, obj: str, chunk: Any) -> EventStream:
        head = self._head(obj)

        if gen.req.include_usage:  # every chunk says usage: null, the last one has it
            head["usage"] = None

        def events() -> Iterator[dict[str, Any]]:
            if obj == "chat.completion.chunk":  # the role first, as OpenAI sends it
                yield {**head, "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None} for i in range(gen.req.n)]}
            for ev in gen.events():
                yield {**head, "choices": [chunk(gen, ev)]}
            if gen.req.include_usage:
                yield {**head, "choices": [], "usage": gen.usage()}
        return EventStream(events(), gen.close)

    def _head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl" if obj.startswith("chat") else "cmpl"
        return {"id": f"{prefix}-{uuid.uuid4().hex[:16]}", "object": obj,
                "created": int(time.time()), "model": self.model_name}

    def _envelope(self, obj: str, choices: list, gen: Generation) -> dict[str, Any]:
        return {**self._head(obj), "choices": choices, "usage": gen.usage()}

    def _encode(self, text: str) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text))

    def _decode(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:
            return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def _pieces(self, tokens: list[int]) -> list[str]:
        """Each token's own text (special tokens included), for logprobs."""
        with self._tokenizer_lock:
            return [str(self.tokenizer.decode([t])) for t in tokens]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SESSIONS_PREFIX = "/sessions/"


def _session_route(route: str) -> tuple[str, str | None]:
    """``/sessions/<id>/v1/...`` -> (``/v1/...``, id); any other route -> (route, None)."""
    if not route.startswith(SESSIONS_PREFIX):
        return route, None
    sid, _, rest = route[len(SESSIONS_PREFIX):].partition("/")
    if not SESSION_ID.fullmatch(sid):
        raise HttpError(400, "a session id is 1 to 64 characters of A-Z a-z 0-9 _ . -")
    return "/" + rest, sid
