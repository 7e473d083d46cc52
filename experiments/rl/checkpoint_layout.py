"""The training layout a checkpoint was written with, and the check that a resume asks for the
same one: the optimizer state (and, for megatron, the weights) are saved per rank, sharded by
that layout, and another layout would load them into tensors of other shapes."""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from experiments.rl.checkpoint import META, CheckpointDir
from system.errors import ConfigError
from workers.engines.configs import TorchEngineConfig


def layout_of(actor: TorchEngineConfig, model_workers: int) -> dict[str, Any]:
    """What a checkpoint's shards depend on (recorded in its ``meta.json``)."""
    megatron = actor.backend == "megatron"
    return {"backend": actor.backend, "model_workers": int(model_workers),
            "tp": actor.megatron.tp if megatron else 1, "pp": actor.megatron.pp if megatron else 1}


def describe(layout: Mapping[str, Any]) -> str:
    split = (f", rl.actor.megatron.tp={layout.get('tp')}, pp={layout.get('pp')}"
             if layout.get("backend") == "megatron" else "")
    return (f"rl.actor.backend={layout.get('backend')}{split} over "
            f"model.count={layout.get('model_workers')}")


def saved_layout(checkpoints: str) -> tuple[int, dict[str, Any] | None] | None:
    """``(step, layout)`` of the newest readable checkpoint under ``checkpoints`` (layout None
    for one written before layouts were recorded), or None when there is none. Reads only."""
    if not os.path.isdir(checkpoints):
        return None
    ckpt = CheckpointDir(checkpoints)
    step = ckpt.latest()
    if step is None:
        return None
    with open(os.path.join(ckpt.path(step), META)) as f:
        layout = json.load(f).get("layout")
    return step, layout if isinstance(layout, dict) else None


def check_resume_layout(checkpoints: str, now: Mapping[str, Any]) -> None:
    """ConfigError (one line) when the newest checkpoint under ``checkpoints`` was written by
    another layout than ``now``."""
    found = saved_layout(checkpoints)
    if found is None or found[1] is None:
        return
    step, saved = found
    if dict(saved) == dict(now):
        return
    raise ConfigError(
        f"the latest checkpoint (step {step}) was written by {describe(saved)}; this run asks "
        f"{describe(now)}: a resume needs the layout its optimizer state is sharded by. Launch "
        "it with that layout; or start over (recover=off recover.overwrite=true); or train a new "
        f"trial from its weights (rl.model_path={os.path.join(checkpoints, f'step_{step}', 'actor')})")


def check_resume_critic(checkpoints: str, algorithm: str) -> None:
    """ConfigError (one line) when this run trains a critic (``rl.algorithm=ppo``) and the
    newest checkpoint under ``checkpoints`` has none to resume it from (written by a run
    without one: ``grpo``). The other way round is fine: a critic the run does not train is
    left unread."""
    if algorithm != "ppo" or not os.path.isdir(checkpoints):
        return
    ckpt = CheckpointDir(checkpoints)
    step = ckpt.latest()
    if step is None or os.path.isdir(os.path.join(ckpt.path(step), "critic")):
        return
    raise ConfigError(
        f"rl.algorithm=ppo: the latest checkpoint (step {step}) has no critic to resume (it "
        "was trained without one, rl.algorithm=grpo). Continue it with rl.algorithm=grpo; or "
        "start over (recover=off recover.overwrite=true); or train a new trial from its "
        f"weights (rl.model_path={os.path.join(checkpoints, f'step_{step}', 'actor')})")


SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "vocab_size")
"""The ``config.json`` fields that make two models' weights interchangeable (or not)."""


def check_resume_model(checkpoints: str, base_model: str) -> None:
    """ConfigError (one line) when the newest checkpoint's actor is another model than
    ``base_model`` (``rl.model_path``, or the experiment's own): the generation servers start
    from the base model and take the checkpoint's weights, which would not fit (it failed at
    the first weight sync, naming a parameter no spec maps). Unreadable configs: not judged."""
    found = saved_layout(checkpoints)
    if found is None:
        return
    step = found[0]
    actor = os.path.join(checkpoints, f"step_{step}", "actor")
    try:
        with open(os.path.join(actor, "config.json")) as f:
            saved = json.load(f)
        with open(os.path.join(base_model, "config.json")) as f:
            base = json.load(f)
    except (OSError, ValueError):
        return
    if not isinstance(saved, dict) or not isinstance(base, dict):
        return
    differ = [f"{k} {saved[k]} against {base[k]}" for k in SHAPE_KEYS  # (where both say:
              if k in saved and k in base and saved[k] != base[k]]  # a default may be left out)
    if differ:
        raise ConfigError(
            f"the latest checkpoint (step {step}) holds another model than rl.model_path="
            f"{base_model} ({', '.join(differ)}): a trial continues from the model it was "
            "trained from. Launch it with that rl.model_path; or start over (recover=off "
            "recover.overwrite=true); or train a new trial from its weights "
            f"(rl.model_path={actor})")


def nothing_to_train(cfg: Any, trial_root: str) -> str | None:
    """A continued training run whose newest checkpoint is at or past ``rl.total_steps``: the
    line saying so (every worker would start, train nothing and stop), else None."""
    found = saved_layout(os.path.join(trial_root, "checkpoints"))
    if found is None or found[0] < cfg.rl.total_steps:
        return None
    return (f"{cfg.exp}/{cfg.trial} is trained to step {found[0]} already (its latest "
            f"checkpoint), rl.total_steps={cfg.rl.total_steps}: nothing to train; raise "
            "rl.total_steps to train on, or start over with recover=off recover.overwrite=true")
