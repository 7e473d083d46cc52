"""Wire format of every socket: msgpack body + zero-copy tensor frames, authenticated.

A message is a ZeroMQ multipart ``[auth || body, buf_0, ..., buf_n-1]``:

- ``body`` is msgpack of the payload; numpy arrays and torch tensors inside it are replaced by an
  ext record ``(index, dtype, shape)`` pointing at ``buf_i``, so tensors never pass through
  msgpack and are sent and received without copies.
- ``auth`` is ``nonce(16) || tag(16)``. The tag covers the frame count, every frame's length and
  every frame's bytes, so frames cannot be reordered, dropped, added or resized. Small messages
  (control calls) are tagged with keyed BLAKE2b; large ones with Poly1305 under a one-time key
  ``BLAKE2b(secret, nonce)`` (Poly1305 keys must never repeat, the random nonce guarantees it),
  which runs at several GB/s, so authenticating 64 MiB tensors costs milliseconds. The two
  uses of the secret are domain-separated by BLAKE2b's personalisation string.

No pickle anywhere: only msgpack types, numpy arrays and torch tensors cross the wire.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import struct
from typing import Any, Sequence

import msgpack
import numpy as np
from cryptography.hazmat.primitives.poly1305 import Poly1305

from system.errors import WireError

NONCE_BYTES = 16
TAG_BYTES = 16
AUTH_BYTES = NONCE_BYTES + TAG_BYTES
SECRET_BYTES = 32
SMALL_MESSAGE_BYTES = 2048  # up to this, BLAKE2b (no per-message key setup); above, Poly1305

_EXT_NUMPY = 1
_EXT_TORCH = 2
# torch dtypes that numpy cannot hold travel as raw bytes with their torch name
_TORCH_ONLY = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


def new_secret() -> bytes:
    """32 random bytes: the per-trial secret every peer authenticates with."""
    return os.urandom(SECRET_BYTES)


@dataclasses.dataclass
class DropCounters:
    """Messages a receiver dropped, by reason."""

    malformed: int = 0
    unauthenticated: int = 0
    oversized: int = 0

    @property
    def total(self) -> int:
        return self.malformed + self.unauthenticated + self.oversized

    def as_dict(self) -> dict[str, int]:
        return {"malformed": self.malformed, "unauthenticated": self.unauthenticated,
                "oversized": self.oversized}


class DroppedMessage(WireError):
    """Raised by :meth:`Codec.decode` for a frame set that must be dropped; ``reason`` is one of
    the :class:`DropCounters` field names."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class Codec:
    """Encodes payloads to authenticated frames and back. One per trial secret."""

    def __init__(self, secret: bytes, max_message_bytes: int = 1 << 30) -> None:
        if len(secret) < 16:
            raise WireError("secret must be at least 16 bytes")
        self._secret = bytes(secret)
        self.max_message_bytes = int(max_message_bytes)

    # --- encode ---
    def encode(self, payload: Any) -> list[Any]:
        """Frames for ``payload``: ``[auth + body, *buffers]`` (buffers are zero-copy views)."""
        buffers: list[memoryview] = []

        def default(obj: Any) -> Any:
            if isinstance(obj, np.ndarray):
                arr = np.ascontiguousarray(obj)
                if arr.dtype.hasobject:
                    raise WireError("object arrays cannot be sent")
                buffers.append(memoryview(arr).cast("B") if arr.size else memoryview(b""))
                return msgpack.ExtType(_EXT_NUMPY, msgpack.packb(
                    [len(buffers) - 1, arr.dtype.str, list(arr.shape)]))
            if type(obj).__module__.startswith("torch") and type(obj).__name__ in (
                    "Tensor", "Parameter"):
                t = obj.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                t = t.contiguous()
                name = _torch_dtype_name(t)
                flat = t.reshape(-1)
                if name in _TORCH_ONLY:
                    import torch
                    flat = flat.view(torch.uint8) if t.numel() else flat
                    arr = flat.numpy() if t.numel() else np.empty(0, np.uint8)
                else:
                    arr = flat.numpy()
                buffers.append(memoryview(arr).cast("B") if arr.size else memoryview(b""))
                return msgpack.ExtType(_EXT_TORCH, msgpack.packb(
                    [len(buffers) - 1, name, list(t.shape)]))
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
        nonce = os.urandom(NONCE_BYTES)
        return [nonce + self._tag(nonce, [memoryview(body), *buffers]) + body, *buffers]

    # --- decode ---
    def decode(self, frames: Sequence[Any]) -> Any:
        """Verify and decode frames (bytes, memoryviews or ``zmq.Frame``). Raises
        :class:`DroppedMessage` for anything that must be dropped."""
        views = [_view(f) for f in frames]
        if not views or views[0].nbytes < AUTH_BYTES:
            raise DroppedMessage("malformed", "no frame with an auth header")
        total = sum(v.nbytes for v in views)
        if total > self.max_message_bytes:
            raise DroppedMessage("oversized", f"{total} bytes > limit {self.max_message_bytes}")
        head, buffers = views[0], views[1:]
        body = head[AUTH_BYTES:]
        nonce, tag = bytes(head[:NONCE_BYTES]), bytes(head[NONCE_BYTES:AUTH_BYTES])
        if not hmac.compare_digest(tag, self._tag(nonce, [body, *buffers])):
            raise DroppedMessage("unauthenticated", "tag does not verify")

        def ext_hook(code: int, data: bytes) -> Any:
            idx, dtype, shape = msgpack.unpackb(data, raw=False)
            if not isinstance(idx, int) or not 0 <= idx < len(buffers):
                raise ValueError(f"tensor frame {idx!r} does not exist")
            buf = buffers[idx]
            if code == _EXT_NUMPY:
                return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            if code == _EXT_TORCH:
                return _torch_from_buffer(buf, dtype, shape)
            raise ValueError(f"unknown ext type {code}")

        try:
            return msgpack.unpackb(body, raw=False, ext_hook=ext_hook, strict_map_key=False)
        except Exception as e:
            raise DroppedMessage("malformed", f"bad payload: {e}") from None

    def _tag(self, nonce: bytes, frames: Sequence[memoryview]) -> bytes:
        lengths = [f.nbytes for f in frames]  # memoryviews
        prefix = struct.pack(f"<{len(lengths) + 1}Q", len(lengths), *lengths)
        if sum(lengths) <= SMALL_MESSAGE_BYTES:
            mac: Any = hashlib.blake2b(nonce, key=self._secret, digest_size=TAG_BYTES,
                                       person=b"rlsys-mac-v1")
        else:
            mac = Poly1305(hashlib.blake2b(nonce, key=self._secret, digest_size=32,
                                           person=b"rlsys-poly-v1").digest())
        mac.update(prefix)
        for f in frames:
            mac.update(f)
        return mac.digest() if hasattr(mac, "digest") else mac.finalize()


def _view(frame: Any) -> memoryview:
    if isinstance(frame, memoryview):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf if isinstance(buf, memoryview) else memoryview(buf)
    return memoryview(frame)


def _torch_from_buffer(buf: memoryview, dtype: str, shape: list[int]) -> Any:
    import torch

    tdtype = getattr(torch, dtype)
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=tdtype)
    # received frames are read-only views; torch warns about (but supports) such buffers, and we
    # hand out a tensor that owns a writable copy only if the caller writes into it.
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(tdtype).reshape(shape)
