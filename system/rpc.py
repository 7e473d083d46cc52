"""Control RPC and data streams over ZeroMQ, in the authenticated format of :mod:`system.wire`.

- :class:`RpcServer` (ROUTER) dispatches ``{"id", "m", "a"}`` requests to an explicit table of
  handlers and replies ``{"id", "ok", "r"}`` or ``{"id", "ok": False, "e": {type, message,
  traceback}}``. A request that fails to parse, authenticate or exceeds the size limit is dropped
  and counted in :attr:`RpcServer.drops`; the server keeps serving. A handler that returns a
  :class:`concurrent.futures.Future` is answered when it completes (long calls such as
  generation do not hold up the others).
- :class:`RpcClient` (DEALER) sends requests with ids; every call has a timeout
  (:class:`~system.errors.RpcTimeout`) and remote exceptions come back as
  :class:`~system.errors.RemoteError`.
- :class:`StreamPusher` / :class:`StreamPuller` (PUSH/PULL) move trajectories and samples through
  bounded queues (high-water marks, in messages).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable, Mapping

import zmq

from system.errors import ConfigError, RemoteError, RpcError, RpcTimeout
from system.wire import Codec, DropCounters, DroppedMessage


@dataclasses.dataclass
class RpcConfig:
    """Sockets of every worker."""

    request_timeout: float = 30.0
    """Default seconds to wait for a reply to a control call."""
    max_message_bytes: int = 1 << 30
    """Messages larger than this are dropped and counted (ZeroMQ itself disconnects a peer whose
    single frame exceeds four times this)."""
    stream_hwm: int = 64
    """Bounded queue length (messages) of each stream socket, per side."""

    def __post_init__(self) -> None:
        if self.request_timeout <= 0:
            raise ConfigError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.max_message_bytes < 4096:
            raise ConfigError(f"max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        if self.stream_hwm < 1:
            raise ConfigError(f"stream_hwm must be >= 1, got {self.stream_hwm}")


def _context() -> zmq.Context:
    return zmq.Context.instance()


def _bind_random(sock: zmq.Socket, host: str) -> str:
    sock.bind(f"tcp://{host}:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _limit_frames(sock: zmq.Socket, max_message_bytes: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_message_bytes)


_COPY_BELOW = 1 << 16
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """Send a multipart message: small frames by copy (cheaper), large ones zero-copy."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n = f.nbytes if isinstance(f, memoryview) else len(f)
        sock.send(f, flags | (_SNDMORE if i < last else 0), copy=n < _COPY_BELOW)


def recv_frames(sock: zmq.Socket, timeout: float) -> list[Any] | None:
    """One multipart message, or ``None`` after ``timeout`` seconds. Small frames are copied
    (cheaper than zero-copy frame objects); large ones are received without a copy."""
    sock.setsockopt(zmq.RCVTIMEO, max(0, int(timeout * 1000)))
    try:
        first = sock.recv(copy=False)
    except zmq.Again:
        return None
    frames: list[Any] = [first.bytes if len(first) < _COPY_BELOW else first]
    while sock.getsockopt(_RCVMORE):
        f = sock.recv(copy=False)
        frames.append(f.bytes if len(f) < _COPY_BELOW else f)
    return frames


Handler = Callable[..., Any]


class RpcServer:
    """A ROUTER socket serving a fixed table of handlers. Use from one thread:
    either :meth:`serve_forever` in a thread of its own, or :meth:`poll_once` from a loop."""

    def __init__(self, codec: Codec, host: str, handlers: Mapping[str, Handler]) -> None:
        self._codec = codec
        self._handlers = dict(handlers)
        self._sock = _context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        _limit_frames(self._sock, codec.max_message_bytes)
        self.address = _bind_random(self._sock, host)
        self.drops = DropCounters()
        self.served = 0
        self._lock = threading.Lock()
        # deferred replies: a handler may return a Future; its reply is sent when it completes
        # (other requests are served meanwhile). Completion wakes the poller through a pipe.
        self._done: collections.deque[tuple[bytes, Any, Future]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.pending = 0

    def poll_once(self, timeout: float) -> bool:
        """Serve at most one request (and send the replies of deferred requests that have
        completed); returns whether a request arrived."""
        events = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._wake_r in events:
            self._send_completed()
        if self._sock not in events:
            return False
        frames = recv_frames(self._sock, 0)
        if frames is None:
            return False
        ident, body = frames[0], frames[1:]
        if not isinstance(ident, bytes):
            ident = ident.bytes
        try:
            req = self._codec.decode(body)
            if not isinstance(req, dict) or not isinstance(req.get("m"), str):
                raise DroppedMessage("malformed", "request is not {id, m, a}")
            args = req.get("a") or {}
            if not isinstance(args, dict):
                raise DroppedMessage("malformed", "request args are not a map")
        except DroppedMessage as e:
            with self._lock:
                setattr(self.drops, e.reason, getattr(self.drops, e.reason) + 1)
            return True
        reply = self._dispatch(req.get("id"), req["m"], args)
        result = reply.get("r")
        if isinstance(result, Future):
            self._defer(ident, req.get("id"), result)
            return True
        self._reply(ident, reply)
        return True

    def _defer(self, ident: bytes, req_id: Any, fut: Future) -> None:
        self.pending += 1

        def done(f: Future) -> None:
            self._done.append((ident, req_id, f))
            os.write(self._wake_w, b"x")

        fut.add_done_callback(done)

    def _send_completed(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self._done:
            ident, req_id, fut = self._done.popleft()
            self.pending -= 1
            exc = fut.exception()
            if exc is not None:
                try:
                    raise exc
                except Exception as e:
                    reply = _error_reply(req_id, e)
            else:
                reply = {"id": req_id, "ok": True, "r": fut.result()}
            self._reply(ident, reply)

    def _reply(self, ident: bytes, reply: dict) -> None:
        try:
            out = self._codec.encode(reply)
        except Exception as e:  # the result could not be encoded: say so instead
            out = self._codec.encode(_error_reply(reply.get("id"), e))
        send_frames(self._sock, [ident, *out])
        self.served += 1

    def _dispatch(self, req_id: Any, method: str, args: dict) -> dict:
        handler = self._handlers.get(method)
        if handler is None:
            return {"id": req_id, "ok": False, "e": {
                "type": "NoSuchMethod",
                "message": f"no method {method!r}; valid: {sorted(self._handlers)}",
                "traceback": ""}}
        try:
            return {"id": req_id, "ok": True, "r": handler(**args)}
        except Exception as e:
            return _error_reply(req_id, e)

    def serve_forever(self, stop: threading.Event, poll: float = 0.1) -> None:
        while not stop.is_set():
            self.poll_once(poll)

    def close(self) -> None:
        self._sock.close(linger=0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _error_reply(req_id: Any, e: BaseException) -> dict:
    return {"id": req_id, "ok": False, "e": {
        "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}}


class RpcClient:
    """A DEALER socket talking to one server. Not thread-safe: one thread per client.

    :meth:`call` is a blocking round trip; :meth:`submit` + :meth:`result` let one thread keep
    many calls in flight (on one or several clients)."""

    _ids = itertools.count(1)

    def __init__(self, codec: Codec, address: str, timeout: float = 30.0) -> None:
        self._codec = codec
        self.address = address
        self.timeout = timeout
        self._sock = _context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        _limit_frames(self._sock, codec.max_message_bytes)
        self._sock.connect(address)
        self._replies: dict[int, dict] = {}
        self._waiting: set[int] = set()
        self.drops = DropCounters()

    def submit(self, method: str, **args: Any) -> int:
        req_id = next(self._ids)
        send_frames(self._sock, self._codec.encode({"id": req_id, "m": method, "a": args}))
        self._waiting.add(req_id)
        return req_id

    def result(self, req_id: int, timeout: float | None = None, abandon: bool = True) -> Any:
        """The reply to ``req_id``. On :class:`RpcTimeout` the call is abandoned (a late reply
        is discarded) unless ``abandon`` is False: then it can be waited for again."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        done = False
        try:
            while req_id not in self._replies:
                frames = recv_frames(self._sock, deadline - time.monotonic())
                if frames is None:
                    raise RpcTimeout(f"no reply from {self.address} within {timeout:.1f}s")
                self._receive_one(frames)
            done = True
        finally:
            if done or abandon:
                self._waiting.discard(req_id)
        reply = self._replies.pop(req_id)
        if reply.get("ok"):
            return reply.get("r")
        err = reply.get("e") or {}
        raise RemoteError(str(err.get("type", "Error")), str(err.get("message", "")),
                          str(err.get("traceback", "")))

    def _receive_one(self, frames: list[Any]) -> None:
        try:
            reply = self._codec.decode(frames)
        except DroppedMessage as e:
            setattr(self.drops, e.reason, getattr(self.drops, e.reason) + 1)
            return
        rid = reply.get("id") if isinstance(reply, dict) else None
        if rid in self._waiting:  # replies to abandoned (timed-out) calls are discarded
            self._replies[rid] = reply

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        """One blocking round trip."""
        return self.result(self.submit(method, **args), timeout)

    def abandon(self, req_id: int) -> None:
        """Stop waiting for ``req_id`` (its reply, if it comes, is discarded)."""
        self._waiting.discard(req_id)
        self._replies.pop(req_id, None)

    def close(self) -> None:
        self._sock.close(linger=0)


class StreamPuller:
    """The receiving end of a stream (PULL, binds). Many pushers may connect."""

    def __init__(self, codec: Codec, host: str, hwm: int = 64) -> None:
        self._codec = codec
        self._sock = _context().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        _limit_frames(self._sock, codec.max_message_bytes)
        self.address = _bind_random(self._sock, host)
        self.drops = DropCounters()

    def recv(self, timeout: float) -> Any | None:
        """The next valid message, or ``None`` if none arrived within ``timeout`` seconds.
        Invalid messages are dropped, counted, and waiting continues."""
        deadline = time.monotonic() + timeout
        while True:
            frames = recv_frames(self._sock, deadline - time.monotonic())
            if frames is None:
                return None
            try:
                msg = self._codec.decode(frames)
            except DroppedMessage as e:
                setattr(self.drops, e.reason, getattr(self.drops, e.reason) + 1)
                continue
            return msg

    def close(self) -> None:
        self._sock.close(linger=0)


class StreamPusher:
    """The sending end of a stream (PUSH, connects). :meth:`send` blocks while the bounded
    queue is full, up to ``timeout`` seconds, then raises :class:`RpcTimeout`."""

    def __init__(self, codec: Codec, address: str, hwm: int = 64) -> None:
        self._codec = codec
        self.address = address
        self._sock = _context().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.connect(address)

    def send(self, payload: Any, timeout: float = 30.0) -> None:
        frames = self._codec.encode(payload)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        try:
            send_frames(self._sock, frames)
        except zmq.Again:
            raise RpcTimeout(f"stream {self.address} stayed full for {timeout:.1f}s") from None

    def close(self, linger: float = 2.0) -> None:
        self._sock.close(linger=int(linger * 1000))


__all__ = ["RpcConfig", "RpcServer", "RpcClient", "StreamPuller", "StreamPusher", "RpcError"]
