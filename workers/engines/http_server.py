"""A bounded JSON-over-HTTP server for the endpoints of generation servers.

Built for a network other users of the cluster can reach, so every resource a client can make it
spend is bounded:

- threads: a fixed pool of ``max_connections`` handler threads; up to ``max_queued`` accepted
  connections wait for one, any more is answered ``429`` at once by the accepting thread;
- time: a connection must deliver its whole request (headers and body) within ``read_timeout``
  seconds of a handler taking it, else it is cut (a slowloris client holds a thread that long at
  most); writing the response is bounded by the same timeout;
- memory: at most :data:`MAX_HEADER_BYTES` of request line and headers, and a body only after
  authentication and only up to ``max_body_bytes`` (checked on ``Content-Length`` first).

Every request needs ``Authorization: Bearer <api key>`` (compared in constant time). Every
error, the standard library's own included (a malformed request line, an unknown method), is a
JSON body ``{"error": {"message", "type", "code"}}``. HTTP/1.0: one request per connection.

An app may answer with an :class:`EventStream` instead of a JSON body: server-sent events
(``data: {...}`` per event, then ``data: [DONE]``), each written as it comes; a failure after
the first event is sent as an event ``data: {"error": ...}``. Every write is bounded by
``read_timeout`` like any answer, so a client that stops reading is cut.
"""
from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Callable, Iterator, Protocol

from system.errors import ConfigError
from workers.engines.http_reaper import Deadline, Reaper

log = logging.getLogger("openai-http")

MAX_HEADER_BYTES = 32 << 10
"""Most bytes of request line plus headers one request may send (the standard library alone
allows 100 lines of 64 KiB)."""


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """What one client may make the endpoint spend (see the module's docstring)."""

    max_body_bytes: int = 1 << 20
    max_connections: int = 32
    max_queued: int = 64
    read_timeout: float = 10.0
    request_timeout: float = 600.0
    max_n: int = 64

    def __post_init__(self) -> None:
        for key in ("max_body_bytes", "max_connections", "max_n"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.max_queued < 0:
            raise ConfigError(f"max_queued must be >= 0, got {self.max_queued}")
        for key in ("read_timeout", "request_timeout"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be > 0, got {getattr(self, key)}")


class HttpError(Exception):
    """Answer the request with ``code`` and a JSON error body naming ``message``."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers or {}


class EventStream:
    """A 200 answer as server-sent events: every dict ``events`` yields, as it comes; ``close``
    is called when the answer ends, however it ends (the client went away, an error)."""

    def __init__(self, events: Iterator[dict[str, Any]], close: Callable[[], None]) -> None:
        self.events, self.close = events, close


class JsonApp(Protocol):
    """What the server calls once a request is authenticated and complete."""

    def handle(self, method: str, path: str, body: dict[str, Any] | None
               ) -> dict[str, Any] | EventStream:
        """The JSON answer (200) or a stream of events, or raise :class:`HttpError`."""
        ...


def error_body(code: int, message: str) -> dict[str, Any]:
    """The OpenAI shape of an error."""
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        code, "server_error" if code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code}}


def raw_response(code: int, reason: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.0 response, for the accepting thread's 429 (no handler is involved)."""
    data = json.dumps(body).encode()
    lines = [f"HTTP/1.0 {code} {reason}", "Content-Type: application/json",
             f"Content-Length: {len(data)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


class HeadersTooLarge(Exception):
    """The request line and headers passed :data:`MAX_HEADER_BYTES`."""


class _CappedReader:
    """The connection's buffered reader, counting what ``readline`` (the request line and the
    headers) returns against :data:`MAX_HEADER_BYTES`; ``read`` (the body) is bounded by the
    handler."""

    def __init__(self, raw: Any, cap: int) -> None:
        self._raw, self._left = raw, cap

    def readline(self, limit: int = -1) -> bytes:
        want = self._left + 1 if limit < 0 else min(limit, self._left + 1)
        line = self._raw.readline(want)
        self._left -= len(line)
        if self._left < 0:
            raise HeadersTooLarge()
        return line

    def read(self, n: int = -1) -> bytes:
        return self._raw.read(n)

    def close(self) -> None:
        self._raw.close()


class JsonHttpServer(HTTPServer):
    """The listening socket, its handler pool and its reaper (see the module's docstring)."""

    request_queue_size = 128  # the kernel's backlog: a burst is accepted (and maybe refused) here
    allow_reuse_address = True

    def __init__(self, host: str, port: int, app: JsonApp, api_key: str,
                 limits: HttpLimits) -> None:
        if len(api_key) < 16:
            raise ConfigError("the API key must be at least 16 characters")
        self.app, self.limits = app, limits
        self._key = api_key.encode()
        self.reaper = Reaper()
        self.counters = {"accepted": 0, "rejected": 0}
        self._queue: queue.Queue[tuple[socket.socket, Any]] = queue.Queue()  # bounded above
        self._closing = threading.Event()
        super().__init__((host, port), _Handler)
        self._pool = [threading.Thread(target=self._work, name=f"openai-http-{i}", daemon=True)
                      for i in range(limits.max_connections)]
        for t in self._pool:
            t.start()

    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode("latin-1", "replace"), self._key)

    def process_request(self, request: Any, client_address: Any) -> None:
        """From the accepting thread: queue the connection for the pool, or refuse it now.
        (``unfinished_tasks``: connections queued or in a handler; only this thread adds.)"""
        if self._queue.unfinished_tasks >= self.limits.max_connections + self.limits.max_queued:
            self.counters["rejected"] += 1
            self._reject(request)
            return
        self.counters["accepted"] += 1
        self._queue.put((request, client_address))

    def _reject(self, sock: socket.socket) -> None:
        body = error_body(429, "too many connections to this endpoint: retry later")
        try:
            sock.setblocking(False)
            sock.send(raw_response(429, "Too Many Requests", body, {"Retry-After": "1"}))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.reaper.linger(sock)

    def _work(self) -> None:
        while not self._closing.is_set():
            try:
                request, address = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            linger = False
            try:
                linger = _Handler(request, address, self).linger
            except Exception as e:  # a client that went away mid-answer
                log.debug("connection from %s failed: %s: %s", address, type(e).__name__, e)
            finally:
                self._queue.task_done()
            if linger:
                self.reaper.linger(request)
            else:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("connection from %s failed", client_address, exc_info=True)

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()
        while True:
            try:
                request, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            self.shutdown_request(request)
        self.reaper.close()

    def handler_threads(self) -> int:
        """Live threads of this server (its pool, not counting the accepting thread)."""
        return sum(t.is_alive() for t in self._pool)


class _Handler(BaseHTTPRequestHandler):
    server: JsonHttpServer
    protocol_version = "HTTP/1.0"

    def version_string(self) -> str:
        return "rlsys"

    def setup(self) -> None:
        self.linger = False  # unread input may remain: close gently (the client sees the answer)
        self.timeout = self.server.limits.read_timeout  # each recv and send
        super().setup()
        self.rfile = _CappedReader(self.rfile, MAX_HEADER_BYTES)  # type: ignore[assignment]
        self.deadline: Deadline = self.server.reaper.watch(self.connection,
                                                           self.server.limits.read_timeout)

    def handle(self) -> None:
        try:
            self.handle_one_request()
        except HeadersTooLarge:
            # a request line past the cap leaves the parsed fields unset (as for 414)
            self.requestline = getattr(self, "requestline", "")
            self.request_version = getattr(self, "request_version", "HTTP/1.0")
            self.command = getattr(self, "command", "")
            self.send_error(431, f"request line and headers exceed {MAX_HEADER_BYTES} bytes")
        finally:
            self.server.reaper.unwatch(self.deadline)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """The standard library's errors (and ours) as JSON."""
        if self.deadline.expired:
            code, message = 408, "the request did not arrive in time"
        text = message or self.responses.get(code, ("error",))[0]
        self._send_json(int(code), error_body(int(code), str(text)))

    def do_GET(self) -> None:
        self._serve(read_body=False)

    def do_POST(self) -> None:
        self._serve(read_body=True)

    def _serve(self, read_body: bool) -> None:
        try:
            if self.deadline.expired:  # cut mid-headers: what arrived is not the request
                raise HttpError(408, "the request did not arrive in time")
            if not self.server.authorized(self.headers.get("Authorization")):
                raise HttpError(401, "missing or wrong API key: send 'Authorization: Bearer "
                                "<key>' (the trial directory's api_key file)",
                                {"WWW-Authenticate": "Bearer"})
            body = self._read_json() if read_body else None
            self.server.reaper.unwatch(self.deadline)  # in: the app's time is its own
            out = self.server.app.handle(self.command, self.path, body)
        except HttpError as e:
            self._send_json(e.code, error_body(e.code, e.message), e.headers)
            return
        except Exception as e:
            log.exception("%s %s failed", self.command, self.path[:200])
            self._send_json(500, error_body(500, f"internal error ({type(e).__name__})"))
            return
        if isinstance(out, EventStream):
            self._send_events(out)
        else:
            self._send_json(200, out)

    def _send_events(self, stream: EventStream) -> None:
        self.close_connection = True
        try:
            self.send_response(200)
            for key, value in (("Content-Type", "text/event-stream"),
                               ("Cache-Control", "no-cache"), ("Connection", "close")):
                self.send_header(key, value)
            self.end_headers()
            try:
                for event in stream.events:
                    self._event(json.dumps(event))
            except HttpError as e:
                self._event(json.dumps(error_body(e.code, e.message)))
                return
            except OSError:
                raise
            except Exception as e:
                log.exception("%s %s failed mid-stream", self.command, self.path[:200])
                self._event(json.dumps(error_body(500, f"internal error ({type(e).__name__})")))
                return
            self._event("[DONE]")
        except OSError as e:  # the client went away or stopped reading (the write timed out)
            log.debug("stream to %s cut: %s: %s", self.client_address, type(e).__name__, e)
        finally:
            stream.close()

    def _event(self, data: str) -> None:
        self.wfile.write(b"data: " + data.encode() + b"\n\n")

    def _content_length(self) -> int:
        if self.headers.get("Transfer-Encoding") is not None:
            raise HttpError(411, "Transfer-Encoding is not supported: send a Content-Length")
        values = self.headers.get_all("Content-Length") or []
        if not values:
            raise HttpError(411, "a Content-Length header is required")
        text = values[0].strip()
        if len(set(v.strip() for v in values)) > 1:
            raise HttpError(400, "conflicting Content-Length headers")
        if not (text.isascii() and text.isdigit()) or len(text) > 18:
            raise HttpError(400, f"Content-Length must be a non-negative integer, "
                                 f"got {text[:20]!r}")
        n = int(text)
        if n > self.server.limits.max_body_bytes:
            raise HttpError(413, f"request body of {n} bytes exceeds the limit of "
                                 f"{self.server.limits.max_body_bytes} bytes")
        return n

    def _read_json(self) -> dict[str, Any]:
        n = self._content_length()
        try:
            data = self.rfile.read(n) if n else b""
        except TimeoutError:
            raise HttpError(408, "the request body did not arrive in time") from None
        if self.deadline.expired or len(data) < n:
            raise HttpError(408 if self.deadline.expired else 400,
                            f"request body incomplete: {len(data)} of {n} bytes")
        try:
            body = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise HttpError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise HttpError(400, "request body must be a JSON object")
        return body

    def _send_json(self, code: int, body: dict[str, Any],
                   headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # or a request line too malformed to say
            self.request_version = "HTTP/1.0"  # a status line and headers all the same
        if code >= 400:
            self.linger = True
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
