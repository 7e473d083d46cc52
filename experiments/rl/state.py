"""The master's loop state and its checkpoint: what a resumed run restores on the master.

A checkpoint is a directory (:class:`~experiments.rl.checkpoint.CheckpointDir`): the model
workers write their engines into it, the master adds ``master.pkl`` (its :class:`LoopState`:
step, prompt cursor, buffered groups, history, RNG states) and commits.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import random
from typing import Any

import numpy as np

from workers.schema import GroupMessage

MASTER_STATE = "master.pkl"


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
    eval_before: float | None = None
    rng: Any = None


def load_state(directory: str) -> LoopState:
    """The master's state saved in checkpoint ``directory``; restores the RNGs it saved."""
    with open(os.path.join(directory, MASTER_STATE), "rb") as f:
        state: LoopState = pickle.load(f)
    if state.rng is not None:
        random.setstate(state.rng["python"])
        np.random.set_state(state.rng["numpy"])
    return state


def save_state(directory: str, state: LoopState) -> None:
    state.rng = {"python": random.getstate(), "numpy": np.random.get_state()}
    with open(os.path.join(directory, MASTER_STATE), "wb") as f:
        pickle.dump(state, f)
