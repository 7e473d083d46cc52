"""A model worker's part of a checkpoint: its engines' files, its RNG state, its share of the
digests (:mod:`system.digests`)."""
from __future__ import annotations

import functools
import os
import random
from typing import Any, Mapping

from system.digests import digest_share
from system.files import fsync_path
from workers.schema import Saved


def save_checkpoint(engines: Mapping[str, Any], directory: str, rank: int, world: int,
                    device: str) -> Saved:
    """Write every engine under ``directory/<engine>/`` (model: rank 0, optimizer state: every
    rank; the frozen reference none) and the RNG state, and fsync what this rank wrote. Once
    every rank has written, each digests its share of the files. The ranks agree after each
    part (an engine's save is a collective): a rank whose write failed (a full disk) raises
    once every rank knows, and none goes on to the next engine's collective without it, nor
    is left waiting in one while training goes on. Collective over the ``world`` model
    workers."""
    parts = [functools.partial(_save_engine, eng, os.path.join(directory, which), rank,
                               frozen=which == "ref") for which, eng in engines.items()]
    parts.append(functools.partial(_save_rng, directory, rank, device))
    for part in parts:
        try:
            part()
        except Exception:
            all_written(False, world, device)
            raise
        if not all_written(True, world, device):  # another rank failed: the master hears it
            return {"rank": rank, "digests": {}}
    return {"rank": rank, "digests": digest_share(directory, rank, world)}


def _save_engine(engine: Any, directory: str, rank: int, frozen: bool) -> None:
    os.makedirs(directory, exist_ok=True)
    if not frozen:  # the frozen reference: the base model is its checkpoint
        engine.save(directory, rank)
    fsync_path(directory)


def _save_rng(directory: str, rank: int, device: str) -> None:
    """The RNG state holds tensors and plain lists only, so it loads with
    ``weights_only=True``."""
    import torch

    version, internal, gauss = random.getstate()
    rng: dict[str, Any] = {"torch": torch.get_rng_state(),
                           "python": [version, list(internal), gauss]}
    if device.startswith("cuda"):
        rng["cuda"] = torch.cuda.get_rng_state(device)
    path = os.path.join(directory, f"rng.model{rank}.pt")
    torch.save(rng, path)
    fsync_path(path)
    fsync_path(directory)


def all_written(ok: bool, world: int, device: str) -> bool:
    """Whether every rank wrote its part (this one: ``ok``); collective over the default
    group (one rank: ``ok``)."""
    if world == 1:
        return ok
    import torch
    import torch.distributed as dist

    failed = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(failed)
    return int(failed.item()) == 0
