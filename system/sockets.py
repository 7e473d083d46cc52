"""ZeroMQ sockets of the trial, with their limits and (optionally) CURVE.

Every socket gets, before it binds or connects:

- ``MAXMSGSIZE`` = ``rpc.max_message_bytes`` + the wire's header: libzmq cuts the connection of
  a peer whose frame is larger as soon as it reads the frame's length, before buffering it.
- a bounded receive queue (``RCVHWM``, messages per connection) and a handshake deadline
  (:data:`HANDSHAKE_MS`): a connection that has not completed ZeroMQ's handshake by then is
  closed, so idle or half-open TCP connections do not pile up.
- with ``rpc.curve``: CURVE (Curve25519 key exchange, XSalsa20-Poly1305 on every frame, through
  libsodium). Every process of the trial derives the same server and client key pairs from the
  trial secret; the server's public key is never sent in clear, so a peer without the secret
  cannot complete the handshake and nothing it sends is buffered.

Addresses of bound sockets are ``tcp://host:port#<random>``: the part after ``#`` makes each
bound socket (and each incarnation of a worker) a distinct recipient (:mod:`system.replay`).
"""
from __future__ import annotations

import os
from typing import Any

import zmq
from zmq.utils import z85

from system.wire import OVERHEAD_BYTES, Codec, DroppedMessage

HANDSHAKE_MS = 10_000
"""A connection must complete ZeroMQ's handshake (greeting, CURVE) within this."""
MAX_FRAMES = 1 << 16
"""Frames a message may have; a receiver drains and drops the rest of a longer one."""
_COPY_BELOW = 1 << 16
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


def context() -> zmq.Context:
    return zmq.Context.instance()


def curve_keys(codec: Codec) -> dict[str, bytes]:
    """The trial's CURVE key pairs (Z85), derived from its secret: ``server_public``,
    ``server_secret``, ``client_public``, ``client_secret``."""
    keys = {}
    for side in ("server", "client"):
        secret = z85.encode(codec.derive(b"curve-v1", side.encode()))
        keys[f"{side}_secret"] = secret
        keys[f"{side}_public"] = zmq.curve_public(secret)
    return keys


def make_socket(codec: Codec, kind: int, hwm: int | None = None) -> zmq.Socket:
    """A socket of ``kind`` (ROUTER and PULL bind: the CURVE server side; DEALER and PUSH
    connect) with the trial's limits. ``hwm`` overrides ``codec.recv_hwm`` (streams)."""
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, codec.max_message_bytes + OVERHEAD_BYTES)
    sock.setsockopt(zmq.RCVHWM, hwm or codec.recv_hwm)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    if codec.curve:
        keys = curve_keys(codec)
        if kind in (zmq.ROUTER, zmq.PULL):
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys["server_secret"])
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys["server_public"])
            sock.setsockopt(zmq.CURVE_PUBLICKEY, keys["client_public"])
            sock.setsockopt(zmq.CURVE_SECRETKEY, keys["client_secret"])
    return sock


def bind(sock: zmq.Socket, host: str) -> str:
    """Bind to a free port of ``host``; the address peers reach it at."""
    sock.bind(f"tcp://{host}:*")
    return f"{sock.getsockopt_string(zmq.LAST_ENDPOINT)}#{os.urandom(8).hex()}"


def endpoint(address: str) -> str:
    """The ZeroMQ endpoint of an address (without its ``#`` part)."""
    return address.partition("#")[0]


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """Send a multipart message: small frames by copy (cheaper), large ones zero-copy."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        n = f.nbytes if isinstance(f, memoryview) else len(f)
        sock.send(f, flags | (_SNDMORE if i < last else 0), copy=n < _COPY_BELOW)


def recv_frames(sock: zmq.Socket, timeout: float) -> list[Any] | None:
    """One multipart message, or ``None`` after ``timeout`` seconds. Small frames are copied
    (cheaper than zero-copy frame objects); large ones are received without a copy. A message
    of more than :data:`MAX_FRAMES` frames is drained and raises
    :class:`~system.errors.DroppedMessage` (``oversized``)."""
    sock.setsockopt(zmq.RCVTIMEO, max(0, int(timeout * 1000)))
    try:
        first = sock.recv(copy=False)
    except zmq.Again:
        return None
    frames: list[Any] = [first.bytes if len(first) < _COPY_BELOW else first]
    while sock.getsockopt(_RCVMORE):
        f = sock.recv(copy=False)
        if len(frames) >= MAX_FRAMES:
            _drain(sock)
            raise DroppedMessage("oversized", f"more than {MAX_FRAMES} frames")
        frames.append(f.bytes if len(f) < _COPY_BELOW else f)
    return frames


def _drain(sock: zmq.Socket) -> None:
    while sock.getsockopt(_RCVMORE):
        sock.recv(copy=False)
