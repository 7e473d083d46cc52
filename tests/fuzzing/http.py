"""Hostile HTTP requests against a live OpenAI endpoint on a real vLLM engine.

Every request is written byte for byte on a raw socket, so framing can be wrong too. Each case
knows whether it must be refused: no or a wrong API key, an invalid field (NaN, huge, negative,
wrong type), a body that is not a JSON object, bad framing (``Content-Length``, request line,
headers over the cap, an unknown method), a route or method that does not exist, a slow
client, a flood of connections. The rest are odd but valid (unknown fields, extra headers) and
must be served. Judged:

- a refused case answered 4xx (or 501 for an unknown method) with an OpenAI-shaped JSON error
  whose code is the status: dropped_and_counted; 2xx: wrongly_accepted; 4xx without that body,
  or no answer: miscounted; 500 or 503 (an unhandled error, a dead engine): crashed;
- a valid case answered 200: accepted; 5xx or no answer: crashed; 4xx: miscounted;
- after every batch the engine loop must live and a plain completion must succeed, else
  crashed (and the run stops).
"""
from __future__ import annotations

import dataclasses
import json
import random
import select
import socket
import threading
import time
from typing import Any, Callable

from tests.fuzzing import Budget, Tally
from workers.engines.http_server import HttpLimits

BATCH = 12
"""Cases between two health checks."""
LIMITS = {"http_max_connections": 4, "http_max_queued": 4, "http_read_timeout": 2.0,
          "http_max_body_bytes": 64 << 10, "http_max_n": 8, "http_request_timeout": 120.0}
"""The endpoint's ``generation.http_*`` settings: small, so slow clients and floods show fast."""


@dataclasses.dataclass
class Endpoint:
    """A live endpoint and what its cases need to know about it."""

    address: str
    """``http://host:port``."""
    key: str
    limits: HttpLimits
    vocab: int
    max_model_len: int
    engine_problem: Callable[[], str | None]
    """Why the engine no longer serves (its loop died), or None."""

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.address.rsplit("/", 1)[1].rsplit(":", 1)
        return host, int(port)


@dataclasses.dataclass
class Case:
    data: bytes
    """The whole request as it goes on the wire."""
    refuse: bool
    kind: str


def exchange(ep: Endpoint, data: bytes, timeout: float = 60.0,
             pieces: float = 0.0) -> tuple[int | None, Any]:
    """Send ``data`` (trickled a byte per ``pieces`` seconds when set) and read the answer
    until the server closes: (status or None, JSON body or None)."""
    try:
        with socket.create_connection(ep.host_port, timeout=timeout) as s:
            _send(s, data, pieces)
            return _parse(_read_all(s))
    except OSError:
        return None, None


def _send(s: socket.socket, data: bytes, pieces: float) -> None:
    """All of ``data``, or (trickled) until the server answers; a server that answers before
    it has read everything may cut the connection: its answer is still read."""
    try:
        if not pieces:
            s.sendall(data)
            return
        for i in range(len(data)):
            s.sendall(data[i:i + 1])
            if select.select([s], [], [], pieces)[0]:
                return
    except OSError:
        pass


def _read_all(s: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except OSError:
        pass
    return out


def _parse(raw: bytes) -> tuple[int | None, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    words = head.split(b"\r\n", 1)[0].split()
    if len(words) < 2 or not words[0].startswith(b"HTTP/") or not words[1].isdigit():
        return None, None
    try:
        return int(words[1]), json.loads(body)
    except ValueError:
        return int(words[1]), None


def request(method: str, path: str, body: bytes | None, key: str | None,
            headers: list[tuple[str, str]] | None = None, length: bool = True) -> bytes:
    """A request as a client writes it (``Content-Length`` from ``body`` unless ``length`` is
    False; ``key`` None: no ``Authorization``)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{k}: {v}" for k, v in headers or []]
    if body is not None and length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


# --- bodies -----------------------------------------------------------------------------------

def _ids(rng: random.Random, ep: Endpoint, n: int) -> list[int]:
    return [rng.randrange(ep.vocab) for _ in range(n)]


def valid_body(rng: random.Random, ep: Endpoint) -> tuple[str, dict[str, Any]]:
    """(route, body) of a small request the endpoint must serve."""
    common: dict[str, Any] = {"max_tokens": rng.randint(1, 3)}
    for key, value in [("n", rng.randint(1, 2)), ("temperature", rng.choice([0, 0.7, 1.5])),
                       ("top_p", rng.choice([0.5, 1])), ("ignore_eos", rng.choice([True, False])),
                       ("logprobs", rng.choice([0, 1, True, False, None])),
                       ("stream", rng.choice([False, None])), ("stop", rng.choice(["", [], None])),
                       ("stop_token_ids", _ids(rng, ep, rng.randint(0, 3))),
                       ("model", rng.choice(["tiny", "gpt-4", ""])), ("user", "u" * 50),
                       ("seed", rng.randint(0, 9)), ("x_unknown", {"a": [1, {"b": None}]})]:
        if rng.random() < 0.3:
            common[key] = value
    if rng.random() < 0.25:
        return "/v1/chat/completions", {**common, "messages": [
            {"role": rng.choice(["user", "system"]), "content": "t1 t2 t3"}]}
    prompt: Any = (_ids(rng, ep, rng.randint(1, 8)) if rng.random() < 0.7
                   else " ".join(f"t{i}" for i in _ids(rng, ep, 4)))
    return "/v1/completions", {**common, "prompt": prompt}


_RAW = "\x00raw\x00"


def _invalid(rng: random.Random, ep: Endpoint, chat: bool) -> tuple[str, Any]:
    """One field set to a value the endpoint must refuse (``_RAW + text``: JSON text as is)."""
    big, lim = 2 ** rng.choice([31, 63, 64, 100]), ep.limits
    table: dict[str, list[Any]] = {
        "temperature": [float("nan"), float("inf"), -1e-3, -5, _RAW + "1e999", "1", True, [],
                        {}],
        "top_p": [0, -1, 1.5, float("nan"), "0.5", False, _RAW + "-1e999"],
        "n": [0, -1, lim.max_n + 1, big, 1.5, 2.0, "2", True, [1]],
        "max_tokens": [0, -3, big, 1e300, 2.5, "4", True, ep.max_model_len, {}],
        "stop_token_ids": [7, "7", [-1], [ep.vocab], [big], [1.5], [True], list(range(300)),
                           {"a": 1}],
        "stream": [True, 1, 0, "false", []],
        "stop": ["t3", ["t3"], ["", "x"]],
        "logprobs": [1.5, "1", [], {}],
        "ignore_eos": [1, 0, "true", []],
    }
    if chat:
        table["messages"] = [[], {}, "t1", [{"role": "hacker", "content": "t1"}],
                             [{"role": "user", "content": 5}], ["t1"], [{"role": "user"}], None,
                             [{"role": "user", "content": "t1 " * (ep.max_model_len + 8)}]]
    else:
        table["prompt"] = [[], {}, "", 5, True, None, [-1], [ep.vocab], [big], [1.5], ["1"],
                           [True], [[1, 2]], _ids(rng, ep, ep.max_model_len + 1),
                           "t1 " * (ep.max_model_len + 8)]
    field = rng.choice(sorted(table))
    return field, rng.choice(table[field])


def _dumps(body: Any) -> bytes:
    """JSON text of ``body``, with ``_RAW`` strings written as the text that follows."""
    raws: list[str] = []

    def mark(v: Any) -> Any:
        if isinstance(v, str) and v.startswith(_RAW):
            raws.append(v[len(_RAW):])
            return f"@RAW{len(raws) - 1}@"
        return v

    text = json.dumps({k: mark(v) for k, v in body.items()} if isinstance(body, dict) else body)
    for i, r in enumerate(raws):
        text = text.replace(f'"@RAW{i}@"', r)
    return text.encode()


# --- cases ------------------------------------------------------------------------------------

def _wrong_key(rng: random.Random, key: str) -> list[tuple[str, str]]:
    """An ``Authorization`` header that must not pass (none at all: [])."""
    return rng.choice([[], [("Authorization", "Bearer " + key[:-1])],
                       [("Authorization", "Bearer " + key + "x")],
                       [("Authorization", "Bearer " + (key.swapcase() if key.swapcase() != key
                                                       else key[1:] + key[0]))],
                       [("Authorization", f"Basic {key}")], [("Authorization", key)],
                       [("Authorization", "Bearer")], [("Authorization", "Bearer " + "A" * 4000)],
                       [("Authorization", "Bearer " + rng.randbytes(24).hex())],
                       [("Authorization", f"Bearer {key[:8]} {key[8:]}")],
                       [("Authorization", "Bearer x"), ("Authorization", f"Bearer {key}")]])


def auth_case(rng: random.Random, ep: Endpoint) -> Case:
    """A valid request without the right key."""
    route, body = valid_body(rng, ep)
    method, route, data = rng.choice([("POST", route, _dumps(body)), ("GET", "/v1/models", None),
                                      ("POST", "/v1/nowhere", b"{}")])
    return Case(request(method, route, data, None, _wrong_key(rng, ep.key)), True, "no key")


def field_case(rng: random.Random, ep: Endpoint) -> Case:
    """An authenticated request with 1 to 3 fields the endpoint must refuse."""
    route, body = valid_body(rng, ep)
    what = []
    for _ in range(rng.randint(1, 3)):
        field, value = _invalid(rng, ep, route.endswith("chat/completions"))
        body[field] = value
        what.append(f"{field}={str(value)[:20]!r}")
    return Case(request("POST", route, _dumps(body), ep.key), True, "fields " + ", ".join(what))


def json_case(rng: random.Random, ep: Endpoint) -> Case:
    """An authenticated body that is not a JSON object."""
    body = rng.choice([b"", b"null", b"[1, 2]", b'"prompt"', b"7", b"{", b'{"prompt": [1,]}',
                       b'{"prompt": NaN}', b"[" * 50_000 + b"]" * 50_000,
                       b'{"a":' * 20_000 + b"1" + b"}" * 20_000, rng.randbytes(64),
                       b'{"prompt": "\xff\xfe"}', b"\xef\xbb\xbf{}"])
    return Case(request("POST", "/v1/completions", body, ep.key), True, f"body {body[:16]!r}")


def framing_case(rng: random.Random, ep: Endpoint) -> Case:
    """Broken framing: Content-Length, request line, header size, method, route."""
    body = _dumps(valid_body(rng, ep)[1] | {"prompt": [1, 2]})
    post = lambda headers, length=True: request(  # noqa: E731
        "POST", "/v1/completions", body, ep.key, headers, length)
    over = ep.limits.max_body_bytes + rng.randint(1, 1 << 20)
    cases = [
        (post([("Content-Length", rng.choice(["-1", "abc", "1.5", "0x10", "9" * 30, " ",
                                               "+5", "1e3"]))], False), "bad Content-Length"),
        (post([], False), "no Content-Length"),
        (post([("Transfer-Encoding", "chunked")], False), "chunked"),
        (post([("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 1))],
              False), "two Content-Lengths"),
        (request("POST", "/v1/completions", b" " * over, ep.key), "body over the limit"),
        (post([("Content-Length", str(over))], False), "declared over the limit"),
        (post([("X-Big", "a" * (33 << 10))]), "headers over the cap"),
        (request(rng.choice(["PUT", "DELETE", "PATCH", "post", "OPTIONS"]), "/v1/completions",
                 body, ep.key), "unknown method"),
        (request("GET", "/v1/completions", None, ep.key), "wrong method"),
        (request("POST", "/v1/models", b"{}", ep.key), "wrong method"),
        (request("GET", rng.choice(["/", "/v1", "/v1/models/../../etc/passwd", "/%00",
                                     "/v1/m\xe9dels", "/v1/models/x", "*"]), None, ep.key),
         "no such route"),
        (rng.choice([b"GARBAGE\r\n\r\n", b"GET /v1/models HTTP/9.9\r\n\r\n",
                     b"GET /v1/models HTTP/1.1 x\r\n\r\n", b"POST\r\n\r\n",
                     b"GET /v1/models\r\n\r\n", b"X" + rng.randbytes(100) + b"\r\n\r\n"]),
         "bad request line"),
    ]
    data, kind = rng.choice(cases)
    return Case(data, True, kind)


def valid_case(rng: random.Random, ep: Endpoint) -> Case:
    """Odd but valid: unknown fields, a route with a query or a trailing slash, extra headers,
    the scheme in lower case."""
    route, body = valid_body(rng, ep)
    route += rng.choice(["", "/", "?x=1", "?prompt=evil"])
    headers = [(f"X-{rng.randbytes(4).hex()}", "".join(chr(rng.randint(32, 126))
                                                       for _ in range(rng.randint(0, 200))))
               for _ in range(rng.randint(0, 40))]
    headers.append(("Content-Type", rng.choice(["application/json", "text/plain", "x/y"])))
    data = request("POST", route, _dumps(body), None, headers)
    scheme = rng.choice(["Bearer", "bearer", "BEARER"])
    data = data.replace(b"Host: fuzz\r\n",
                        f"Host: fuzz\r\nAuthorization: {scheme} {ep.key}\r\n".encode(), 1)
    return Case(data, False, "valid " + route)


CASES: list[tuple[float, Callable[[random.Random, Endpoint], Case]]] = [
    (0.2, auth_case), (0.35, field_case), (0.1, json_case), (0.2, framing_case),
    (0.15, valid_case)]
"""(weight, generator) of the cases sent one at a time."""


def hostile_case(rng: random.Random, ep: Endpoint) -> Case:
    weights, gens = zip(*CASES)
    return rng.choices(gens, weights)[0](rng, ep)


# --- judging and running ----------------------------------------------------------------------

REFUSALS = {*range(400, 500), 501, 505}
"""Statuses that refuse a request (501, 505: an unknown method or HTTP version)."""


def judge(tally: Tally, case: Case, status: int | None, body: Any) -> None:
    tally.tried += 1
    error = body.get("error") if isinstance(body, dict) else None
    shaped = isinstance(error, dict) and error.get("code") == status and isinstance(
        error.get("message"), str)
    served = status == 200 and isinstance(body, dict) and ("choices" in body or "data" in body)
    if case.refuse and status is not None and 200 <= status < 300:
        tally.wrongly_accepted += 1
    elif case.refuse and status in REFUSALS and shaped:
        tally.dropped_and_counted += 1
        return
    elif not case.refuse and served:
        tally.accepted += 1
        return
    elif status is None and case.refuse:
        tally.miscounted += 1  # cut without an answer
    elif status is None or status >= 500:
        tally.crashed += 1
    else:
        tally.miscounted += 1
    tally.note(f"{case.kind}: {status} {str(body)[:160]} for {case.data[:160]!r}")


def health(ep: Endpoint, rng: random.Random) -> str | None:
    """None if the engine lives and a plain completion is served (after a flood, once the
    connections it left are gone), else what is wrong."""
    problem = ep.engine_problem()
    if problem:
        return problem
    data = request("POST", "/v1/completions", _dumps({"prompt": _ids(rng, ep, 3),
                                                      "max_tokens": 2}), ep.key)
    for _ in range(20):
        status, body = exchange(ep, data)
        if status != 429:
            break
        time.sleep(0.5)
    if status == 200 and isinstance(body, dict) and len(body.get("choices", [])) == 1:
        return None
    return f"a legitimate completion was answered {status}: {str(body)[:200]}"


def _concurrently(ep: Endpoint, cases: list[Case], pieces: float) -> list[tuple[int | None, Any]]:
    out: list[tuple[int | None, Any]] = [(None, None)] * len(cases)

    def one(i: int) -> None:
        out[i] = exchange(ep, cases[i].data, timeout=ep.limits.read_timeout + 10, pieces=pieces)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def slow_cases(rng: random.Random, ep: Endpoint, n: int) -> list[Case]:
    """Clients trickling their headers or body a byte every 0.25 s: cut (408) at the read
    timeout, whatever they send."""
    trickle = "".join(f"X-Slow-{i}: 1\r\n" for i in range(200))
    head = rng.choice([f"POST /v1/completions HTTP/1.1\r\n{trickle}",
                       f"POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer {ep.key}\r\n"
                       f"Content-Length: 2000\r\n\r\n{{{' ' * 1000}"])
    return [Case(head.encode(), True, "slow") for _ in range(n)]


def flood_cases(rng: random.Random, ep: Endpoint, n: int) -> list[Case]:
    """A burst of connections, each a whole request without the key: 401 from a handler, or
    429 from the accepting thread once handlers and queue are full."""
    return [Case(request("GET", "/v1/models", None, None, _wrong_key(rng, ep.key)), True,
                 "flood") for _ in range(n)]


def http_attack(ep: Endpoint, rng: random.Random, budget: Budget) -> Tally:
    """Batches of :func:`hostile_case`, sometimes a round of slow clients or a flood of
    connections, each followed by a health check."""
    tally = Tally("http")
    for left in budget.rounds(tally):
        pick = rng.random()
        if pick < 0.08:
            cases = slow_cases(rng, ep, min(left, rng.randint(1, ep.limits.max_connections)))
            answers = _concurrently(ep, cases, pieces=0.25)
        elif pick < 0.16:
            room = ep.limits.max_connections + ep.limits.max_queued
            cases = flood_cases(rng, ep, min(left, room + rng.randint(8, 64)))
            answers = _concurrently(ep, cases, pieces=0.0)
        else:
            cases = [hostile_case(rng, ep) for _ in range(min(left, BATCH))]
            answers = [exchange(ep, c.data) for c in cases]
        for case, (status, body) in zip(cases, answers):
            judge(tally, case, status, body)
        problem = health(ep, rng)
        if problem:
            tally.tried += 1
            tally.crashed += 1
            tally.note(f"after {sorted({c.kind for c in cases})}: {problem}")
    return tally


def serve(llm: Any, trial_dir: str, max_model_len: int = 512
          ) -> tuple[Endpoint, Callable[[], None]]:
    """An endpoint on ``llm`` opened the way a generation server opens it (its own engine loop,
    the key from ``trial_dir``'s ``api_key``, :data:`LIMITS`), and how to close it."""
    from system.api_key import write_api_key
    from tests.helpers import generation_server, word_tokenizer
    from workers.engines.vllm_server import GenerationEngine, VllmConfig

    engine = GenerationEngine.from_llm(llm, VllmConfig(max_model_len=max_model_len))
    key = write_api_key(f"{trial_dir}/api_key")
    server = generation_server(trial_dir, dict(LIMITS))
    server.engine = engine
    http = server.serve_http(word_tokenizer(), "tiny")
    assert http is not None

    def problem() -> str | None:
        try:
            engine.check()  # raises once the loop (or vLLM's core under it) died
            return None
        except Exception as e:
            return f"the engine loop died: {type(e).__name__}: {e}"

    def close() -> None:
        http.close()
        server.server.close()
        engine.close()

    return Endpoint(http.address, key, server.gen_cfg.http_limits(), engine.vocab_size,
                    max_model_len, problem), close
