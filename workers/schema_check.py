"""Checks of payloads a worker reads from a stream, before it touches a field.

The wire authenticates who sent a message, not what shape it has: a peer that holds the trial
secret (a buggy or mismatched one) can still send a map with missing keys or arrays of the
wrong kind. A stream consumer passes these to :class:`system.streams.StreamPuller` (``validate``),
which drops and counts what fails, so the consumer never crashes on a bad message.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

_GROUP_FIELDS: dict[str, type | tuple[type, ...]] = {
    "seq": int, "prompt_id": int, "worker": int, "server": int, "trajs": list, "failed": bool,
    "error": str, "unservable": bool, "agent_error": bool}
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
    temps = t.get("temps")
    if temps is not None:
        if not isinstance(temps, np.ndarray) or temps.ndim != 1 or temps.dtype.kind != "f":
            return "temps is not a 1-d float array"
        if len(temps) != completion:
            return f"temps has {len(temps)} entries for {completion} completion tokens"
        if not (np.isfinite(temps) & (temps > 0)).all():
            return "temps holds a temperature that is not a finite number > 0"
    reward = t.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return f"reward is {type(reward).__name__}, not a number"
    if not math.isfinite(reward):
        return f"reward is {reward}"
    return None


def group_message_problem(msg: Any, group_size: int | None = None) -> str | None:
    """What is wrong with a :class:`~workers.schema.GroupMessage`, or None; with
    ``group_size``, a group that did not fail must hold exactly that many sessions (the
    advantages are normalised within each group): trajectories without ``session``, or
    trajectories whose ``session`` indices are 0 .. group_size - 1, each at least once, in
    order, all carrying their session's one reward."""
    problem = _fields_problem(msg, _GROUP_FIELDS)
    if problem:
        return f"group message: {problem}"
    for i, t in enumerate(msg["trajs"]):
        problem = trajectory_problem(t)
        if problem:
            return f"group message, trajectory {i}: {problem}"
    if group_size is not None and not msg["failed"]:
        return _sessions_problem(msg["trajs"], group_size)
    return None


def _sessions_problem(trajs: list[dict[str, Any]], group_size: int) -> str | None:
    keyed = ["session" in t for t in trajs]
    if not any(keyed):
        if len(trajs) != group_size:
            return f"group message: {len(trajs)} trajectories, not {group_size}"
        return None
    if not all(keyed):
        return "group message: some trajectories name their session, some do not"
    sessions = [t["session"] for t in trajs]
    if any(isinstance(k, bool) or not isinstance(k, int) for k in sessions):
        return "group message: a session index is not an integer"
    if sorted(set(sessions)) != list(range(group_size)) or sessions != sorted(sessions):
        return (f"group message: sessions {sorted(set(sessions))[:10]} are not 0..{group_size - 1}"
                " in order")
    rewards: dict[int, float] = {}
    for t in trajs:
        if rewards.setdefault(t["session"], t["reward"]) != t["reward"]:
            return f"group message: session {t['session']} has different rewards"
    return None
