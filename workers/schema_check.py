"""Checks of payloads a worker reads from a stream, before it touches a field.

The wire authenticates who sent a message, not what shape it has: a peer that holds the trial
secret (a buggy or mismatched one) can still send a map with missing keys or arrays of the
wrong kind. A stream consumer passes these to :class:`system.rpc.StreamPuller` (``validate``),
which drops and counts what fails, so the consumer never crashes on a bad message.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

_GROUP_FIELDS: dict[str, type | tuple[type, ...]] = {
    "seq": int, "prompt_id": int, "worker": int, "server": int, "trajs": list, "failed": bool,
    "error": str}
_TRAJ_ARRAYS = {"mask": "iub", "logprobs": "f", "versions": "iu"}


def _fields_problem(msg: Any, fields: dict[str, type | tuple[type, ...]]) -> str | None:
    if not isinstance(msg, dict):
        return f"not a map but {type(msg).__name__}"
    for key, kind in fields.items():
        value = msg.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"field {key!r} is {type(value).__name__}, not {kind}"
    return None


def trajectory_problem(t: Any) -> str | None:
    """What is wrong with a :class:`~workers.schema.Trajectory`, or None."""
    problem = _fields_problem(t, {"prompt_len": int, "finish": str, "tokens": np.ndarray})
    if problem:
        return problem
    tokens = t["tokens"]
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        return f"tokens are {tokens.dtype}{list(tokens.shape)}, not a 1-d integer array"
    if not 0 < t["prompt_len"] <= len(tokens):
        return f"prompt_len {t['prompt_len']} outside 1..{len(tokens)}"
    completion = len(tokens) - t["prompt_len"]
    for key, kinds in _TRAJ_ARRAYS.items():
        a = t.get(key)
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in kinds:
            return f"{key} is not a 1-d array of kind {kinds}"
        if len(a) != completion:
            return f"{key} has {len(a)} entries for {completion} completion tokens"
    reward = t.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return f"reward is {type(reward).__name__}, not a number"
    if not math.isfinite(reward):
        return f"reward is {reward}"
    return None


def group_message_problem(msg: Any, group_size: int | None = None) -> str | None:
    """What is wrong with a :class:`~workers.schema.GroupMessage`, or None; with
    ``group_size``, a group that did not fail must hold exactly that many trajectories (the
    advantages are normalised within each group)."""
    problem = _fields_problem(msg, _GROUP_FIELDS)
    if problem:
        return f"group message: {problem}"
    if group_size is not None and not msg["failed"] and len(msg["trajs"]) != group_size:
        return f"group message: {len(msg['trajs'])} trajectories, not {group_size}"
    for i, t in enumerate(msg["trajs"]):
        problem = trajectory_problem(t)
        if problem:
            return f"group message, trajectory {i}: {problem}"
    return None
