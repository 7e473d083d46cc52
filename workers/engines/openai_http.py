"""An OpenAI-compatible HTTP endpoint on a generation server, for external agents.

``GET /v1/models``, ``POST /v1/completions`` (``prompt``: text or token ids) and
``POST /v1/chat/completions`` (the tokenizer's chat template). Requests go to the same engine
as our RPC path, so they share its continuous batch and its weight versions; every choice says
which versions produced its tokens (``weight_versions``), an extension to the OpenAI schema.
Standard-library HTTP server, one thread per connection.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from system.errors import ConfigError
from workers.engines.vllm_server import GenerationEngine, Sampling

log = logging.getLogger("openai-http")


class OpenAIEndpoint:
    def __init__(self, engine: GenerationEngine, tokenizer: Any, model_name: str, host: str,
                 port: int = 0, timeout: float = 600.0) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.timeout = timeout
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet
                log.debug(fmt, *args)

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": endpoint.model_name, "object": "model", "owned_by": "rlsys"}]})
                else:
                    self._send(404, _error(f"no route {self.path}"))

            def do_POST(self) -> None:
                try:
                    n = int(self.headers.get("Content-Length", 0))
                    body = json.loads(self.rfile.read(n) or b"{}")
                    if not isinstance(body, dict):
                        raise ConfigError("request body must be a JSON object")
                    route = self.path.rstrip("/")
                    if route == "/v1/completions":
                        self._send(200, endpoint.completions(body))
                    elif route == "/v1/chat/completions":
                        self._send(200, endpoint.chat(body))
                    else:
                        self._send(404, _error(f"no route {self.path}"))
                except (ConfigError, ValueError, TypeError, KeyError) as e:
                    self._send(400, _error(str(e)))
                except Exception as e:  # the engine failed
                    log.exception("request failed")
                    self._send(500, _error(f"{type(e).__name__}: {e}", "server_error"))

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.address = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="openai-http",
                                        daemon=True)
        self._thread.start()

    def _sampling(self, body: dict) -> tuple[Sampling, int]:
        n = int(body.get("n", 1))
        stop = body.get("stop_token_ids") or ()
        return Sampling(max_tokens=int(body.get("max_tokens", 16)),
                        temperature=float(body.get("temperature", 1.0)),
                        top_p=float(body.get("top_p", 1.0)), stop_token_ids=tuple(stop)), n

    def _run(self, prompt_ids: list[int], body: dict) -> tuple[list[dict], int]:
        sampling, n = self._sampling(body)
        samples = self.engine.submit(prompt_ids, n, sampling).result(self.timeout)
        return samples, len(prompt_ids)

    def completions(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = prompt
        elif isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            raise ConfigError("prompt must be a string or a list of token ids")
        samples, plen = self._run(ids, body)
        choices = []
        for i, s in enumerate(samples):
            tokens = [int(t) for t in s["tokens"]]
            choice = {"index": i, "text": self._decode(tokens), "finish_reason": s["finish"],
                      "weight_versions": s["segments"]}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {
                    "tokens": [self.tokenizer.decode([t]) for t in tokens],
                    "token_ids": tokens, "token_logprobs": [float(x) for x in s["logprobs"]]}
            choices.append(choice)
        return self._envelope("text_completion", choices, plen, samples)

    def chat(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ConfigError("messages must be a non-empty list")
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True)
            if hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
        else:  # a tokenizer without a template: plain concatenation of the contents
            ids = self.tokenizer.encode("".join(str(m.get("content", "")) for m in messages))
        samples, plen = self._run(list(ids), body)
        choices = [{"index": i, "message": {"role": "assistant",
                                            "content": self._decode([int(t) for t in s["tokens"]])},
                    "finish_reason": s["finish"], "weight_versions": s["segments"]}
                   for i, s in enumerate(samples)]
        return self._envelope("chat.completion", choices, plen, samples)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _envelope(self, obj: str, choices: list, plen: int, samples: list[dict]) -> dict:
        completion = sum(len(s["tokens"]) for s in samples)
        return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": obj, "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": plen, "completion_tokens": completion,
                          "total_tokens": plen + completion}}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind}}
