"""Control RPC and data streams over ZeroMQ, in the authenticated format of :mod:`system.wire`.

- :class:`RpcServer` (ROUTER) dispatches requests (:class:`Request`) to an explicit table of
  handlers and answers each with one :class:`Reply`, bound to the request it answers. A request
  that fails to parse, authenticate, is too large, is meant for another server or was already
  received (:mod:`system.replay`) is dropped and counted in :attr:`RpcServer.drops`; the server
  keeps serving. A handler that returns a :class:`concurrent.futures.Future` is answered when it
  completes (long calls such as generation do not hold up the others). A reply that cannot
  be delivered (its caller closed or restarted, or stopped reading) is dropped, never waited
  for, and counted in :attr:`RpcServer.unsent`.
- :class:`RpcClient` (DEALER) sends requests; every call has a timeout
  (:class:`~system.errors.RpcTimeout`) and remote exceptions come back as
  :class:`~system.errors.RemoteError`. It accepts one reply per request in flight.
Streams (PUSH/PULL): :mod:`system.streams`. Sockets and their limits: :mod:`system.sockets`.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any, Callable, Mapping, TypedDict

import zmq

from system.errors import (ClientClosed, ConfigError, NotSent, RemoteError, RpcError,
                           RpcTimeout, WireError)
from system.replay import LateReply, ReplyReceiver, Receiver, Sender
from system.sockets import bind, endpoint, make_socket, recv_frames, send_frames
from system.wire import Channel, Codec, DropCounters, DroppedMessage, Header, recipient_id

log = logging.getLogger("rpc")

CLOSE_LINGER_MS = 200
"""How long a closing server lets its last replies leave (ZeroMQ's linger, milliseconds)."""
UNSENT_KEPT = 1024
"""Requests a client remembers as not sent, until their result is asked for."""


@dataclasses.dataclass
class RpcConfig:
    """Sockets of every worker."""

    request_timeout: float = 30.0
    """Default seconds to wait for a reply to a control call."""
    max_message_bytes: int = 1 << 30
    """Largest message (msgpack body plus tensor frames) a worker sends or accepts. A sender
    refuses a larger one (``WireError``); ZeroMQ cuts the connection of a peer that sends a
    larger frame before buffering it; a larger message of several frames is dropped and
    counted."""
    stream_hwm: int = 64
    """Bounded queue length (messages) of each stream socket, per side."""
    recv_hwm: int = 1000
    """Bounded receive queue (messages per connection) of every request/reply socket."""
    curve: bool = False
    """Encrypt and authenticate every ZeroMQ connection with CURVE, keys derived from the trial
    secret (see ``system/sockets.py``): a peer without the secret cannot complete a handshake,
    so nothing it sends is buffered or read. Costs throughput on large messages."""

    def __post_init__(self) -> None:
        if self.request_timeout <= 0:
            raise ConfigError(f"request_timeout must be > 0, got {self.request_timeout}")
        if self.max_message_bytes < 4096:
            raise ConfigError(f"max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        if self.stream_hwm < 1:
            raise ConfigError(f"stream_hwm must be >= 1, got {self.stream_hwm}")
        if self.recv_hwm < 1:
            raise ConfigError(f"recv_hwm must be >= 1, got {self.recv_hwm}")

    def codec(self, secret: bytes) -> Codec:
        """The codec of a trial whose secret is ``secret``, with these limits."""
        return Codec(secret, self.max_message_bytes, curve=self.curve, recv_hwm=self.recv_hwm)


class RemoteErrorInfo(TypedDict):
    type: str
    message: str
    traceback: str


class Request(TypedDict):
    """What a client sends: method name and keyword arguments."""

    m: str
    a: dict[str, Any]


class Reply(TypedDict, total=False):
    """What a server answers: ``ok`` and the result ``r``, or ``ok: False`` and the error ``e``."""

    ok: bool
    r: Any
    e: RemoteErrorInfo


def _request(payload: Any) -> Request:
    if not isinstance(payload, dict) or not isinstance(payload.get("m"), str):
        raise DroppedMessage("malformed", "request is not {m, a}")
    # not `.get("a") or {}`: an array has no truth value (the serving thread died on one), and
    # 0, "", [] or None are no map of arguments either
    args = payload.get("a")
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise DroppedMessage("malformed", "request args are not a map of names")
    return {"m": payload["m"], "a": args}


Handler = Callable[..., Any]


class RpcServer:
    """A ROUTER socket serving a fixed table of handlers. Use from one thread:
    either :meth:`serve_forever` in a thread of its own, or :meth:`poll_once` from a loop."""

    def __init__(self, codec: Codec, host: str, handlers: Mapping[str, Handler]) -> None:
        self._handlers = dict(handlers)
        self._sock = make_socket(codec, zmq.ROUTER)
        # an undeliverable reply raises (counted) instead of vanishing; sends never block
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.address = bind(self._sock, host)
        self._in = Receiver(codec, Channel.REQUEST, self.address)
        self._out = Sender(codec, Channel.REPLY)
        self.drops = DropCounters()
        self.served = 0
        self.unsent = 0
        """Replies dropped: their caller was gone (closed, restarted) or its queue was full."""
        # deferred replies: a handler may return a Future; its reply is sent when it completes
        # (other requests are served meanwhile). Completion wakes the poller through a pipe.
        self._deferred: dict[int, tuple[bytes, Header, str]] = {}  # by key: who asked what
        self._keys = itertools.count()
        self._done: collections.deque[tuple[int, Future]] = collections.deque()
        self._closed = False
        self._close_lock = threading.Lock()  # a completion never writes to a closed pipe
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
        try:
            frames = recv_frames(self._sock, 0)
            if frames is None:
                return False
            ident = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
            msg = self._in.open(frames[1:])
            req = _request(msg.payload)
        except DroppedMessage as e:
            self.drops.count(e.reason)
            return True
        reply = self._dispatch(req["m"], req["a"])
        result = reply.get("r")
        if isinstance(result, Future):
            self._defer(ident, msg.header, req["m"], result)
            return True
        self._reply(ident, msg.header, reply)
        return True

    def _defer(self, ident: bytes, request: Header, method: str, fut: Future) -> None:
        key = next(self._keys)
        self._deferred[key] = (ident, request, method)
        self.pending += 1

        def done(f: Future) -> None:  # (in the thread that completed it)
            with self._close_lock:
                if self._closed:  # answered by close(); its pipe may be another file now
                    return
                self._done.append((key, f))
                os.write(self._wake_w, b"x")

        fut.add_done_callback(done)

    def _send_completed(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while self._done:
            key, fut = self._done.popleft()
            ident, request, _ = self._deferred.pop(key)
            self.pending -= 1
            exc = fut.exception()
            if exc is not None:
                try:
                    raise exc
                except Exception as e:
                    reply = _error_reply(e)
            else:
                reply = {"ok": True, "r": fut.result()}
            self._reply(ident, request, reply)

    def _reply(self, ident: bytes, request: Header, reply: Reply) -> None:
        """Answer ``request`` (the reply is bound to its sender and counter)."""
        try:
            out = self._out.seal(reply, request.sender, request.counter).frames
        except Exception as e:  # the result could not be encoded: say so instead
            out = self._out.seal(_error_reply(e), request.sender, request.counter).frames
        # counted first: a caller that has its answer finds it counted (counted after the send,
        # a loaded CI run read served=1 after two answered calls)
        self.served += 1
        try:
            send_frames(self._sock, [ident, *out], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: no such caller now; EAGAIN: its queue is full
            self.unsent += 1
            log.debug("server %s: reply to %s dropped (%s)", self.address, request.sender, e)

    def _dispatch(self, method: str, args: dict[str, Any]) -> Reply:
        handler = self._handlers.get(method)
        if handler is None:
            return {"ok": False, "e": {
                "type": "NoSuchMethod",
                "message": f"no method {method!r}; valid: {sorted(self._handlers)}",
                "traceback": ""}}
        try:
            return {"ok": True, "r": handler(**args)}
        except Exception as e:
            return _error_reply(e)

    def serve_forever(self, stop: threading.Event, poll: float = 0.1) -> None:
        while not stop.is_set():
            self.poll_once(poll)

    def close(self) -> None:
        """Close the socket (and every connection to it); idempotent. Call it once serving has
        stopped. Deferred calls still running are answered first, with an error (their
        callers, a master waiting on a training step, say, fail at once instead of waiting out
        their timeout); completed ones with their results."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        answered = bool(self._deferred)
        if answered:
            self._send_completed()
            for ident, request, method in self._deferred.values():
                self._reply(ident, request, {"ok": False, "e": {
                    "type": "WorkerStopped", "traceback": "",
                    "message": f"{method}: the server stopped before the call completed"}})
            self.pending -= len(self._deferred)
            self._deferred.clear()
        # (a moment for the replies just sent to leave; nothing else is waited for)
        self._sock.close(linger=CLOSE_LINGER_MS if answered else 0)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


def _error_reply(e: BaseException) -> Reply:
    return {"ok": False, "e": {"type": type(e).__name__, "message": str(e),
                               "traceback": traceback.format_exc()}}


def _reply(payload: Any) -> Reply | None:
    """The reply in ``payload``, or None if it is not ``{ok, r | e}``."""
    if isinstance(payload, dict) and payload.get("ok") is True:
        return {"ok": True, "r": payload.get("r")}
    err = payload.get("e") if isinstance(payload, dict) else None
    if isinstance(payload, dict) and payload.get("ok") is False and isinstance(err, dict):
        return {"ok": False, "e": {"type": str(err.get("type", "Error")),
                                   "message": str(err.get("message", "")),
                                   "traceback": str(err.get("traceback", ""))}}
    return None


class RpcClient:
    """A DEALER socket talking to one server. Not thread-safe: one thread per client.

    :meth:`call` is a blocking round trip; :meth:`submit` + :meth:`result` let one thread keep
    many calls in flight (on one or several clients)."""

    def __init__(self, codec: Codec, address: str, timeout: float = 30.0) -> None:
        self.address = address
        self.timeout = timeout
        self._sock = make_socket(codec, zmq.DEALER)
        # a DEALER with no peer to send to, or whose queue to it is full (ZeroMQ's "mute"
        # state: a peer gone, or not reading), blocks a send; it may do so for the call's
        # timeout, not forever
        self._sock.setsockopt(zmq.SNDTIMEO, int(min(max(timeout, 0.001), 2e6) * 1000))
        self._sock.connect(endpoint(address))
        self._server = recipient_id(address)
        self._out = Sender(codec, Channel.REQUEST)
        self._in = ReplyReceiver(codec, self._out)
        self._replies: dict[int, Reply] = {}
        self._unsent: dict[int, str] = {}  # request id -> why it could not be sent
        self._mute = False  # the last send found no peer to take it
        self.drops = DropCounters()

    def submit(self, method: str, **args: Any) -> int:
        """Send a request; returns its id (the request's counter) for :meth:`result`. A
        request that could not be queued within the client's timeout fails there, as
        :class:`~system.errors.NotSent` (an :class:`RpcTimeout`; so a fan-out still collects
        every other reply). After such a send, the next ones do not wait: each is queued if
        the queue has room again (the peer took what was queued), else fails at once: a
        client whose queue is full, or whose connection ZeroMQ dropped, costs the send's
        wait once, not per call.
        :class:`~system.errors.ClientClosed` once :meth:`close` was called."""
        if self._sock.closed:
            raise ClientClosed(f"{method} to {self.address}: this client was closed")
        sealed = self._out.seal({"m": method, "a": args}, self._server)
        self._in.expect(sealed.counter)
        try:
            send_frames(self._sock, sealed.frames, zmq.NOBLOCK if self._mute else 0)
            self._mute = False
        except zmq.Again:
            self._in.abandon(sealed.counter)
            why = ("at once (no peer took the request before it either)" if self._mute else
                   f"within {self.timeout:.1f}s (no peer took it)")
            self._unsent[sealed.counter] = f"{method} to {self.address}: not sent {why}"
            self._mute = True
            while len(self._unsent) > UNSENT_KEPT:  # (calls whose result nobody asks for)
                del self._unsent[next(iter(self._unsent))]
        return sealed.counter

    def result(self, req_id: int, timeout: float | None = None, abandon: bool = True) -> Any:
        """The reply to ``req_id``. On :class:`RpcTimeout` the call is abandoned (a late reply
        is discarded) unless ``abandon`` is False: then it can be waited for again."""
        if req_id in self._unsent:
            raise NotSent(self._unsent.pop(req_id))
        if self._sock.closed and req_id not in self._replies:
            raise ClientClosed(f"no reply from {self.address}: this client was closed")
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while req_id not in self._replies:
            try:
                frames = recv_frames(self._sock, deadline - time.monotonic())
            except DroppedMessage as e:  # too many frames
                self.drops.count(e.reason)
                continue
            if frames is None:
                if abandon:
                    self._in.abandon(req_id)
                raise RpcTimeout(f"no reply from {self.address} within {timeout:.1f}s")
            self._receive_one(frames)
        reply = self._replies.pop(req_id)
        if reply.get("ok"):
            return reply.get("r")
        err = reply["e"]
        raise RemoteError(err["type"], err["message"], err["traceback"])

    def _receive_one(self, frames: list[Any]) -> None:
        try:
            msg = self._in.open(frames)
        except LateReply:  # the reply to an abandoned (timed-out) call
            return
        except DroppedMessage as e:
            self.drops.count(e.reason)
            return
        reply = _reply(msg.payload)
        if reply is None:  # authentic but not a reply: fail the call rather than hang it
            self.drops.count("malformed")
            reply = {"ok": False, "e": {"type": "MalformedReply", "traceback": "",
                                        "message": f"not {{ok, r|e}}: {str(msg.payload)[:200]}"}}
        self._replies[msg.header.reply_to] = reply

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        """One blocking round trip."""
        return self.result(self.submit(method, **args), timeout)

    def abandon(self, req_id: int) -> None:
        """Stop waiting for ``req_id`` (its reply, if it comes, is discarded)."""
        self._in.abandon(req_id)
        self._replies.pop(req_id, None)
        self._unsent.pop(req_id, None)

    def close(self) -> None:
        self._sock.close(linger=0)


__all__ = ["Reply", "Request", "RpcConfig", "RpcServer", "RpcClient", "RpcError", "WireError"]
