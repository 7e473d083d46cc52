"""Model workers: load the actor (and reference, critic) engines, install them, serve."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
from typing import Any, Sequence

from experiments.rl.algorithms.objectives import ActorLossConfig, actor_loss, critic_loss
from experiments.rl.checkpoint import CheckpointDir
from experiments.rl.common import model_path, rl_config
from experiments.rl.config import model_config
from workers.engines.configs import TorchEngineConfig
from workers.model import ModelWorker
from workers.schema import TrainItem

log = logging.getLogger("rl-model")


def _actor_loss(batch: Sequence[TrainItem], cfg: dict[str, Any], stats: dict[str, float]) -> Any:
    return actor_loss(batch, ActorLossConfig(**cfg), stats)


def engine_class(cfg: TorchEngineConfig) -> Any:
    """The engine of ``cfg.backend``: FSDP2 (``TorchEngine``) or megatron-core."""
    if cfg.backend == "megatron":
        from workers.engines.megatron_engine import MegatronEngine

        return MegatronEngine
    from workers.engines.torch_engine import TorchEngine

    return TorchEngine


def model_role(worker: ModelWorker) -> dict[str, Any]:
    rl = rl_config(worker)
    path = model_path(worker, rl)
    rl.actor.check_layout(worker.world_size, model_config(path), key="rl.actor.megatron")
    engine = engine_class(rl.actor)
    resume_dir = resume_dir_of(worker)
    worker.init_default_group()
    actor_path = os.path.join(resume_dir, "actor") if resume_dir else path
    actor = engine(dataclasses.replace(rl.actor, model_path=actor_path), worker.device,
                   worker.world_size)
    engines = {"actor": actor}
    if rl.loss.kl_coef > 0:
        engines["ref"] = engine(dataclasses.replace(rl.actor, model_path=path),
                                worker.device, worker.world_size, trainable=False)
    if rl.algorithm == "ppo":
        critic_path = os.path.join(resume_dir, "critic") if resume_dir else path
        engines["critic"] = engine(
            dataclasses.replace(rl.actor, model_path=critic_path, lr=rl.critic_lr),
            worker.device, worker.world_size, head="value")
    if resume_dir:
        for which, eng in engines.items():
            if which != "ref":
                eng.load_optimizer(os.path.join(resume_dir, which), worker.index)
        restore_rng(resume_dir, worker.index, worker.device)
    worker.install(engines, actor_loss=_actor_loss, critic_loss=critic_loss)
    worker.wait_stop()
    return {"engines": sorted(engines), "steps": actor.steps}


def resume_dir_of(worker: ModelWorker) -> str | None:
    """The latest checkpoint's directory when resuming (``recover=resume``), once this rank
    has checked its share of the checkpoint's content (:meth:`CheckpointDir.check_content`):
    :class:`CorruptCheckpoint` if it differs (the checkpoint is marked: the restart that
    follows resumes from the one before it)."""
    if worker.config["recover"] != "resume":
        return None
    ckpt = CheckpointDir(os.path.join(worker.boot.trial_dir, "checkpoints"))
    step = ckpt.latest()
    if step is None:
        return None
    return ckpt.restorable(step, worker.index, worker.world_size)


def restore_rng(directory: str, rank: int, device: str) -> None:
    """Put back the torch (and this device's CUDA) and Python RNG states that
    :meth:`ModelWorker.save` wrote for ``rank``, so a resumed run draws what the first would
    have. Loaded with ``weights_only=True``: a checkpoint must not run code."""
    import torch

    path = os.path.join(directory, f"rng.model{rank}.pt")
    if not os.path.isfile(path):  # e.g. more model workers than the checkpoint had
        log.warning("%s is missing: rank %d keeps fresh RNG states", path, rank)
        return
    blob = torch.load(path, map_location="cpu", weights_only=True)
    torch.set_rng_state(blob["torch"])
    if "cuda" in blob and device.startswith("cuda"):
        torch.cuda.set_rng_state(blob["cuda"], device)
    version, internal, gauss = blob["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
