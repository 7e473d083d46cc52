"""The registry of worker kinds: name -> worker class, in start order (master last)."""
from __future__ import annotations

import importlib

KINDS: dict[str, str] = {
    "model": "workers.model:ModelWorker",
    "generation": "workers.generation:GenerationServer",
    "rollout": "workers.rollout:RolloutWorker",
    "master": "workers.master:MasterWorker",
}


def worker_class(kind: str) -> type:
    if kind not in KINDS:
        raise KeyError(f"unknown worker kind {kind!r}; valid: {sorted(KINDS)}")
    module, _, cls = KINDS[kind].partition(":")
    return getattr(importlib.import_module(module), cls)
