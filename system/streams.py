"""Data streams over ZeroMQ, in the authenticated format of :mod:`system.wire`:
:class:`StreamPusher` / :class:`StreamPuller` (PUSH/PULL) move trajectories and samples through
bounded queues (high-water marks, in messages); a puller may check each message's schema. A
message that fails to parse, authenticate or pass the check, is meant for another stream, or was
already received is dropped and counted in :attr:`StreamPuller.drops`.

Control RPC: :mod:`system.rpc`. Sockets and their limits: :mod:`system.sockets`.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import zmq

from system.errors import RpcTimeout
from system.replay import Receiver, Sender
from system.sockets import bind, endpoint, make_socket, recv_frames, send_frames
from system.wire import Channel, Codec, DropCounters, DroppedMessage, recipient_id

log = logging.getLogger("streams")


Validate = Callable[[Any], "str | None"]
"""A stream's schema check: ``None`` for a valid message, else what is wrong with it."""


class StreamPuller:
    """The receiving end of a stream (PULL, binds). Many pushers may connect. ``validate``
    (optional) checks each message's schema: one it rejects is dropped and counted as
    ``malformed``, so a consumer only ever sees messages of the shape it reads."""

    def __init__(self, codec: Codec, host: str, hwm: int = 64,
                 validate: Validate | None = None) -> None:
        self._sock = make_socket(codec, zmq.PULL, hwm)
        self.address = bind(self._sock, host)
        self._in = Receiver(codec, Channel.STREAM, self.address)
        self._validate = validate
        self.drops = DropCounters()

    def recv(self, timeout: float) -> Any | None:
        """The next valid message, or ``None`` if none arrived within ``timeout`` seconds.
        Invalid messages are dropped, counted, and waiting continues."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                frames = recv_frames(self._sock, deadline - time.monotonic())
                if frames is None:
                    return None
                msg = self._in.open(frames).payload
                problem = self._validate(msg) if self._validate is not None else None
                if problem is not None:
                    raise DroppedMessage("malformed", problem)
            except DroppedMessage as e:
                self.drops.count(e.reason)
                log.debug("stream %s dropped a message: %s", self.address, e)
                if time.monotonic() >= deadline:  # a flood of bad messages cannot hold us
                    return None
                continue
            return msg

    def close(self) -> None:
        self._sock.close(linger=0)


class StreamPusher:
    """The sending end of a stream (PUSH, connects). :meth:`send` blocks while the bounded
    queue is full, up to ``timeout`` seconds, then raises :class:`RpcTimeout`."""

    def __init__(self, codec: Codec, address: str, hwm: int = 64) -> None:
        self.address = address
        self._sock = make_socket(codec, zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.connect(endpoint(address))
        self._to = recipient_id(address)
        self._out = Sender(codec, Channel.STREAM)

    def send(self, payload: Any, timeout: float = 30.0) -> None:
        frames = self._out.seal(payload, self._to).frames
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        try:
            send_frames(self._sock, frames)
        except zmq.Again:
            raise RpcTimeout(f"stream {self.address} stayed full for {timeout:.1f}s") from None

    def close(self, linger: float = 2.0) -> None:
        self._sock.close(linger=int(linger * 1000))
