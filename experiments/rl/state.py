"""The master's loop state and its checkpoint: what a resumed run restores on the master.

A checkpoint is a directory (:class:`~experiments.rl.checkpoint.CheckpointDir`): the model
workers write their engines into it, the master adds ``master.msgpack`` (its :class:`LoopState`:
step, prompt cursor, buffered groups, history, RNG states) and commits.

No pickle: loading a checkpoint must not run code, so the state is msgpack of plain values, with
numpy arrays as an extension record ``[dtype, shape, raw bytes]``.
"""
from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import msgpack
import numpy as np

from experiments.rl.checkpoint import write_durable
from workers.schema import GroupMessage

MASTER_STATE = "master.msgpack"
FORMAT = 1
_EXT_ARRAY = 1


@dataclasses.dataclass
class Admitted:
    """A group the master accepted into its buffer, with its prompt's epoch."""

    group: GroupMessage
    epoch: int


@dataclasses.dataclass
class LoopState:
    """What a checkpoint restores on the master."""

    step: int = 0
    consumed: int = 0
    """Groups trained on."""
    cursor: dict[str, Any] | None = None
    buffer: list[tuple[Admitted, int]] = dataclasses.field(default_factory=list)
    """Buffered groups with their weight versions (only while saving a checkpoint)."""
    history: list[list[list[int]]] = dataclasses.field(default_factory=list)
    """[prompt id, epoch] of every group trained on, per step."""
    max_staleness: int = 0
    staleness_bound: int | None = None
    """The bound (``rl.max_head_offpolicyness``) ``max_staleness`` was measured under: a run
    that continues the trial with another one measures afresh (None: an older checkpoint)."""
    dropped_stale: int = 0
    """Groups dropped as too stale, over every master up to this state (so are the two below:
    leases that ran out, and leases of rollout workers found dead)."""
    leases_expired: int = 0
    leases_released: int = 0
    filtered: int = 0
    """Groups dynamic sampling filtered out (``rl.dynamic_sampling``: all rewards equal)."""
    eval_before: float | None = None
    loop_seconds: float = 0.0
    """Seconds the loop ran (start-up and the first evaluation excluded) up to this state, over
    every master that trained it (a restart's redone steps count once)."""
    issued: int = 0
    """The sequence number the tasks, and their sampling seeds, go on from after a restart
    (:meth:`~experiments.rl.data.TaskSource.resume_seq`; 0: an older checkpoint)."""
    rng: dict[str, Any] | None = None
    """``{"python": [version, [ints], gauss], "numpy": [name, keys, pos, has_gauss, gauss]}``:
    plain values (see :func:`capture_rng`)."""


def capture_rng() -> dict[str, Any]:
    """Python's and numpy's global RNG states as plain values (lists, ints, floats, arrays)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {"python": [version, list(internal), gauss],
            "numpy": [name, np.asarray(keys), int(pos), int(has_gauss), float(cached)]}


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the global RNGs to a state from :func:`capture_rng`."""
    version, internal, gauss = rng["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                         float(cached)))


def _default(obj: Any) -> Any:
    """msgpack hook: arrays as ``[dtype, shape, bytes]`` records, numpy scalars as Python's."""
    if isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
        arr = np.ascontiguousarray(obj)
        return msgpack.ExtType(_EXT_ARRAY, msgpack.packb(
            [arr.dtype.str, list(arr.shape), arr.tobytes()]))
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"a checkpoint cannot hold a {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_ARRAY:
        raise ValueError(f"unknown extension record {code} in the master state")
    dtype, shape, raw = msgpack.unpackb(data)
    # a copy: frombuffer over bytes is read-only, and the loop may write into restored arrays
    return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()


def encode_state(state: LoopState) -> bytes:
    """``state`` as msgpack (tuples become lists; :func:`decode_state` rebuilds them)."""
    fields = dataclasses.asdict(dataclasses.replace(state, buffer=[]))
    fields["buffer"] = [{"group": item.group, "epoch": item.epoch, "version": version}
                        for item, version in state.buffer]
    return msgpack.packb({"format": FORMAT, **fields}, default=_default)


def decode_state(data: bytes) -> LoopState:
    """The :class:`LoopState` that :func:`encode_state` wrote."""
    raw = msgpack.unpackb(data, ext_hook=_ext_hook)
    if raw.pop("format", None) != FORMAT:
        raise ValueError("not a master state of this format")
    buffer = [(Admitted(b["group"], int(b["epoch"])), int(b["version"]))
              for b in raw.pop("buffer")]
    return LoopState(buffer=buffer, **raw)


def load_state(directory: str) -> LoopState:
    """The master's state saved in checkpoint ``directory``; restores the RNGs it saved."""
    with open(os.path.join(directory, MASTER_STATE), "rb") as f:
        state = decode_state(f.read())
    if state.rng is not None:
        restore_rng(state.rng)
    return state


def save_state(directory: str, state: LoopState) -> None:
    """Write (and fsync) the master's state, with the current RNG states, into ``directory``."""
    state.rng = capture_rng()
    write_durable(os.path.join(directory, MASTER_STATE), encode_state(state))
