"""Wire format of every socket: an authenticated header, a msgpack body and zero-copy tensor
frames.

A message is a ZeroMQ multipart ``[header || tag || body, buf_0, ..., buf_n-1]``:

- ``header`` (:class:`Header`, 50 bytes) says which channel the message travels on (request,
  reply, stream), who sent it (a random per-socket sender id and that sender's message counter),
  whom it is for (the recipient's identity: a server's or stream's address, or for a reply the
  client's sender id) and, for a reply, the counter of the request it answers. Receivers drop
  a message meant for another recipient or channel, or one they have already seen
  (:mod:`system.replay`), so a captured message cannot be replayed, nor sent elsewhere.
- ``body`` is msgpack of the payload; numpy arrays and torch tensors inside it are replaced by an
  ext record pointing at ``buf_i`` (:mod:`system.wire_tensors`), so tensors never pass through
  msgpack and are sent and received without copies.
- ``tag`` (16 bytes) covers the header, the frame count, every frame's length and every frame's
  bytes, so nothing can be changed, reordered, dropped, added or resized. Small messages (control
  calls) are tagged with keyed BLAKE2b; large ones with Poly1305 under a one-time key
  ``BLAKE2b(secret, sender id || counter)`` (a sender never repeats a counter, so the key never
  repeats), which runs at several GB/s. Uses of the secret are domain-separated by BLAKE2b's
  personalisation string (:meth:`Codec.derive`).

No pickle anywhere: only msgpack types, numpy arrays and torch tensors cross the wire.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
import struct
from typing import Any, Callable, NamedTuple, Sequence

import msgpack
import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

from system.errors import WireError
from system.wire_tensors import (TensorFrameError, ext_decoder, is_torch_tensor, numpy_record,
                                 torch_record)

VERSION = 2
ID_BYTES = 16
TAG_BYTES = 16
_HEADER = struct.Struct(">BB16sQ16sQ")  # version, channel, sender, counter, recipient, reply_to
HEADER_BYTES = _HEADER.size
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
"""Bytes the wire adds to a payload's body (frame 0)."""
SECRET_BYTES = 32
SMALL_MESSAGE_BYTES = 2048  # up to this, BLAKE2b (no per-message key setup); above, Poly1305


class Channel(enum.IntEnum):
    """What a message is: the MAC binds it, so a request cannot be pushed into a stream."""

    REQUEST = 1
    REPLY = 2
    STREAM = 3


class Header(NamedTuple):
    """The authenticated header of one message."""

    channel: Channel
    sender: bytes
    """The sending socket's random id (:class:`system.replay.Sender`)."""
    counter: int
    """The sender's message number: starts at 1, never repeats."""
    recipient: bytes
    """The recipient's identity: :func:`recipient_id` of its address, or a client's sender id."""
    reply_to: int = 0
    """A reply: the counter of the request it answers; otherwise 0."""

    def pack(self) -> bytes:
        return _HEADER.pack(VERSION, self.channel, self.sender, self.counter, self.recipient,
                            self.reply_to)


_CHANNELS = {int(c): c for c in Channel}


class Message(NamedTuple):
    header: Header
    payload: Any


def new_secret() -> bytes:
    """32 random bytes: the per-trial secret every peer authenticates with."""
    return os.urandom(SECRET_BYTES)


def recipient_id(address: str) -> bytes:
    """The identity a server or stream is addressed by: a digest of its published address
    (which carries a random part per incarnation, so a restarted one is a new recipient)."""
    return hashlib.blake2b(address.encode(), digest_size=ID_BYTES, person=b"rlsys-rcpt").digest()


@dataclasses.dataclass
class DropCounters:
    """Messages a receiver dropped, by reason."""

    malformed: int = 0
    unauthenticated: int = 0
    oversized: int = 0
    replayed: int = 0
    """Authentic, but already received (or a reply to no request in flight)."""
    misdirected: int = 0
    """Authentic, but meant for another recipient or channel."""

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def count(self, reason: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)


class DroppedMessage(WireError):
    """Raised by :meth:`Codec.decode` for a frame set that must be dropped; ``reason`` is one of
    the :class:`DropCounters` field names."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


Admit = Callable[[Header], None]
"""What a receiver checks of an authentic header before the body is parsed (raises
:class:`DroppedMessage`): recipient, channel, replay."""


class Codec:
    """Seals payloads into authenticated frames and opens them. One per trial secret; it also
    holds what every socket of the trial needs (size limit, receive queue bound, CURVE)."""

    def __init__(self, secret: bytes, max_message_bytes: int = 1 << 30, *, curve: bool = False,
                 recv_hwm: int = 1000) -> None:
        if len(secret) < 16:
            raise WireError("secret must be at least 16 bytes")
        self._secret = bytes(secret)
        self.max_message_bytes = int(max_message_bytes)
        """Largest payload (body plus tensor frames) sent or accepted."""
        self.curve = curve
        """Encrypt and authenticate every connection with CURVE (:mod:`system.sockets`)."""
        self.recv_hwm = int(recv_hwm)
        """Messages queued per connection on a receiving socket before its sender waits."""
        self._small_mac = hashlib.blake2b(key=self._secret, digest_size=TAG_BYTES,
                                          person=b"rlsys-mac-v2")  # copied per message

    def derive(self, purpose: bytes, context: bytes = b"", size: int = 32) -> bytes:
        """A key for ``purpose`` (at most 10 bytes, e.g. ``b"curve"``) and ``context``, derived
        from the secret."""
        return hashlib.blake2b(context, key=self._secret, digest_size=size,
                               person=b"rlsys-" + purpose).digest()

    # --- encode ---
    def encode(self, payload: Any, header: Header) -> list[Any]:
        """Frames for ``payload``: ``[header + tag + body, *buffers]`` (buffers are zero-copy
        views). Use a :class:`system.replay.Sender`, which numbers the headers."""
        buffers: list[memoryview] = []

        def default(obj: Any) -> Any:
            try:
                if isinstance(obj, np.ndarray):
                    return numpy_record(obj, buffers)
                if is_torch_tensor(obj):
                    return torch_record(obj, buffers)
            except TypeError as e:
                raise WireError(str(e)) from None
            if isinstance(obj, (np.integer, np.floating, np.bool_)):
                return obj.item()
            if isinstance(obj, (set, frozenset)):
                return list(obj)
            raise WireError(f"cannot send object of type {type(obj).__name__}")

        try:
            body = msgpack.packb(payload, default=default, use_bin_type=True)
        except WireError:
            raise
        except Exception as e:
            raise WireError(f"cannot encode payload: {e}") from e
        size = len(body) + sum(b.nbytes for b in buffers)
        if size > self.max_message_bytes:
            raise WireError(f"message of {size} bytes exceeds rpc.max_message_bytes="
                            f"{self.max_message_bytes}")
        head = header.pack()
        return [head + self._tag(head, [memoryview(body), *buffers]) + body, *buffers]

    # --- decode ---
    def decode(self, frames: Sequence[Any], admit: Admit) -> Message:
        """Verify frames (bytes, memoryviews or ``zmq.Frame``), let ``admit`` check the header,
        then parse. Raises :class:`DroppedMessage` for anything that must be dropped."""
        views = [_view(f) for f in frames]
        if not views or views[0].nbytes < OVERHEAD_BYTES:
            raise DroppedMessage("malformed", "no frame with a header")
        total = sum(v.nbytes for v in views) - OVERHEAD_BYTES
        if total > self.max_message_bytes:
            raise DroppedMessage("oversized", f"{total} bytes > limit {self.max_message_bytes}")
        head, tag = bytes(views[0][:HEADER_BYTES]), bytes(views[0][HEADER_BYTES:OVERHEAD_BYTES])
        body, buffers = views[0][OVERHEAD_BYTES:], views[1:]
        if not hmac.compare_digest(tag, self._tag(head, [body, *buffers])):
            raise DroppedMessage("unauthenticated", "tag does not verify")
        header = _parse_header(head)
        admit(header)
        try:
            payload = msgpack.unpackb(body, raw=False, strict_map_key=False,
                                      ext_hook=ext_decoder(buffers) if buffers else _no_ext)
        except Exception as e:  # TensorFrameError, msgpack's errors, ...
            raise DroppedMessage("malformed", f"bad payload: {e}") from None
        return Message(header, payload)

    def _tag(self, head: bytes, frames: Sequence[memoryview]) -> bytes:
        lengths = [f.nbytes for f in frames]  # memoryviews
        prefix = struct.pack(f"<{len(lengths) + 1}Q", len(lengths), *lengths)
        if sum(lengths) <= SMALL_MESSAGE_BYTES:
            mac: Any = self._small_mac.copy()
        else:  # the one-time key: sender id and counter, which never repeat
            mac = Poly1305(self.derive(b"poly-v2", head[2:26]))
        mac.update(head + prefix)
        for f in frames:
            mac.update(f)
        return mac.digest() if hasattr(mac, "digest") else mac.finalize()


def _no_ext(code: int, data: bytes) -> Any:
    raise TensorFrameError("a tensor record, but the message has no tensor frames")


def _parse_header(head: bytes) -> Header:
    version, channel, sender, counter, recipient, reply_to = _HEADER.unpack(head)
    if version != VERSION or channel not in _CHANNELS:
        raise DroppedMessage("malformed", f"version {version}, channel {channel}")
    return Header(_CHANNELS[channel], sender, counter, recipient, reply_to)


def _view(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf if isinstance(buf, memoryview) else memoryview(buf)
    return memoryview(frame)


__all__ = ["Channel", "Codec", "DropCounters", "DroppedMessage", "Header", "Message",
           "TensorFrameError", "new_secret", "recipient_id"]
