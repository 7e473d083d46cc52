"""Tensors on the wire: numpy arrays and torch tensors as zero-copy frames, typed by allow-list.

A tensor inside a payload becomes a msgpack ext record ``[frame index, dtype name, shape]`` and
its bytes travel as a frame of their own. On receipt the dtype must be one of the names below
(never ``getattr`` on a module with a name a peer chose) and the shape must account for exactly
the frame's bytes, so a peer cannot make a receiver allocate more than it was sent.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

EXT_NUMPY = 1
EXT_TORCH = 2
MAX_DIMS = 32

# numpy dtypes by their ``dtype.str``: little-endian (and byte-order-free) numbers only
NUMPY_DTYPES: dict[str, np.dtype] = {np.dtype(t).str: np.dtype(t) for t in (
    "bool", "int8", "uint8", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8",
    "<f2", "<f4", "<f8", "<c8", "<c16")}
# torch dtypes by name (``str(dtype)`` without ``torch.``), with their item size; the last three
# have no numpy equivalent and travel as raw bytes
TORCH_ITEMSIZE: dict[str, int] = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2,
    "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_TORCH_RAW = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


class TensorFrameError(ValueError):
    """A tensor record that does not describe its frame (bad index, dtype or shape)."""


def is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and type(obj).__name__ in (
        "Tensor", "Parameter")


def numpy_record(arr: np.ndarray, buffers: list[memoryview]) -> msgpack.ExtType:
    """Append ``arr``'s bytes to ``buffers``; the ext record that points at them."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.str not in NUMPY_DTYPES:
        raise TypeError(f"numpy dtype {arr.dtype} cannot be sent "
                        f"(allowed: {sorted(NUMPY_DTYPES)})")
    buffers.append(memoryview(arr).cast("B") if arr.size else memoryview(b""))
    return msgpack.ExtType(EXT_NUMPY, msgpack.packb(
        [len(buffers) - 1, arr.dtype.str, list(arr.shape)]))


def torch_record(obj: Any, buffers: list[memoryview]) -> msgpack.ExtType:
    """The same for a torch tensor (moved to the CPU, made contiguous)."""
    import torch

    t = obj.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if name not in TORCH_ITEMSIZE:
        raise TypeError(f"torch dtype {name} cannot be sent (allowed: {sorted(TORCH_ITEMSIZE)})")
    flat = t.reshape(-1)
    if not t.numel():
        arr = np.empty(0, np.uint8)
    else:
        arr = (flat.view(torch.uint8) if name in _TORCH_RAW else flat).numpy()
    buffers.append(memoryview(arr).cast("B") if arr.size else memoryview(b""))
    return msgpack.ExtType(EXT_TORCH, msgpack.packb([len(buffers) - 1, name, list(t.shape)]))


def _checked_shape(shape: Any, itemsize: int, nbytes: int) -> tuple[int, ...]:
    """``shape`` as a tuple, if it is a list of non-negative ints whose elements fill exactly
    ``nbytes``."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            type(d) is int and d >= 0 for d in shape):
        raise TensorFrameError(f"bad shape {shape!r}")
    if math.prod(shape) * itemsize != nbytes:
        raise TensorFrameError(f"shape {shape} of {itemsize}-byte items does not fill the "
                               f"frame's {nbytes} bytes")
    return tuple(shape)


def ext_decoder(buffers: Sequence[memoryview]) -> Callable[[int, bytes], Any]:
    """The msgpack ``ext_hook`` that turns records back into arrays over ``buffers`` (read-only
    views, no copies). Raises :class:`TensorFrameError` for a record that does not fit."""
    def ext_hook(code: int, data: bytes) -> Any:
        record = msgpack.unpackb(data, raw=False)
        if not isinstance(record, list) or len(record) != 3:
            raise TensorFrameError("a tensor record is [index, dtype, shape]")
        idx, dtype, shape = record
        if type(idx) is not int or not 0 <= idx < len(buffers):
            raise TensorFrameError(f"tensor frame {idx!r} does not exist")
        buf = buffers[idx]
        if code == EXT_NUMPY and isinstance(dtype, str) and dtype in NUMPY_DTYPES:
            dt = NUMPY_DTYPES[dtype]
            return np.frombuffer(buf, dtype=dt).reshape(_checked_shape(shape, dt.itemsize,
                                                                       buf.nbytes))
        if code == EXT_TORCH and isinstance(dtype, str) and dtype in TORCH_ITEMSIZE:
            return _torch_from_buffer(buf, dtype, _checked_shape(shape, TORCH_ITEMSIZE[dtype],
                                                                 buf.nbytes))
        raise TensorFrameError(f"ext type {code} with dtype {dtype!r} is not allowed")
    return ext_hook


def _torch_from_buffer(buf: memoryview, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    tdtype = getattr(torch, dtype)  # dtype is a key of TORCH_ITEMSIZE, checked by the caller
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=tdtype)  # the shape holds a 0: nothing is allocated
    # received frames are read-only views; torch warns about (but supports) such buffers, and we
    # hand out a tensor that owns a writable copy only if the caller writes into it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
    return raw.view(tdtype).reshape(shape)
