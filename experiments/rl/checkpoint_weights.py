"""The policy's weights in a saved checkpoint, without a model worker.

Both training engines checkpoint the actor as a Hugging Face model in
``<trial>/checkpoints/step_<N>/actor/``: ``config.json`` plus safetensors with HF names and full
(unsharded) tensors in the master dtype. The torch engine's rank 0 gathers the FSDP2 shards and
writes it with ``save_pretrained`` (which leaves out ``lm_head.weight`` when it is tied to the
embedding); the megatron engine gathers its tp x pp shards into HF names
(:meth:`~workers.engines.megatron_engine.MegatronEngine.save_hf`). A generation server loads
that directory as it is (the disk path of weight sync, ``rl.weight_sync.mode=disk``), and
:func:`checkpoint_state_dict` reads it as the engine's own full state dict. The optimizer
shards (``optimizer.rank<R>.pt``) are not needed for either.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

from system.errors import ConfigError

ACTOR = "actor"
"""The policy's engine directory inside a checkpoint."""


class CheckpointFormatError(ConfigError):
    """A checkpoint whose policy weights cannot be read as a Hugging Face model."""


def actor_dir(step_dir: str, backend: str = "fsdp") -> str:
    """The directory of the policy's HF weights in checkpoint ``step_dir`` (what a generation
    server loads); refuses, in one line naming ``backend``, one that holds none."""
    d = os.path.join(step_dir, ACTOR)
    if not os.path.isfile(os.path.join(d, "config.json")) or not safetensors_files(d):
        raise CheckpointFormatError(
            f"checkpoint {step_dir} holds no Hugging Face weights of the policy in {ACTOR}/ "
            f"(config.json and *.safetensors; rl.actor.backend={backend}): it cannot be "
            "evaluated")
    return d


def safetensors_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.safetensors")))


def checkpoint_state_dict(step_dir: str, backend: str = "fsdp") -> dict[str, Any]:
    """The policy's full state dict in HF naming, as the engine holds it (its
    ``full_state_dict`` in the master dtype): every safetensors file of ``actor/``, with the
    output embedding put back where the model ties it to the input one."""
    from safetensors.torch import load_file

    d = actor_dir(step_dir, backend)
    state: dict[str, Any] = {}
    for path in safetensors_files(d):
        state.update(load_file(path))
    with open(os.path.join(d, "config.json")) as f:
        tied = bool(json.load(f).get("tie_word_embeddings", True))  # (HF's own default)
    if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state
