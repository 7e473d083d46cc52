"""The RL experiments: ``arith-tiny`` (the default run) and ``smollm2-arith``.

Roles (in :mod:`experiments.rl.roles`): model workers host the torch engines (actor; reference
when ``rl.loss.kl_coef > 0``; critic for PPO); generation servers host vLLM plus an
OpenAI-compatible endpoint; rollout workers take prompts from the master, run the agent against
the server the master picked, score the samples and stream the groups back; the master runs the
loop in :mod:`experiments.rl.loop`.
"""
from __future__ import annotations

import os

from experiments.registry import Experiment, Roles
from experiments.rl.checkpoint_layout import (check_resume_critic, check_resume_layout,
                                              check_resume_model, layout_of, nothing_to_train)
from experiments.rl.config import RLExperimentConfig, model_dir
from experiments.rl.roles.evaluator import eval_master_role, nothing_to_evaluate
from experiments.rl.roles.generation import generation_role
from experiments.rl.roles.master import master_role
from experiments.rl.roles.model import model_role
from experiments.rl.roles.rollout import rollout_role
from experiments.rl.warm import PREPARE, WARM
from workers.engines.configs import TorchEngineConfig

ROLES = Roles(master=master_role, model=model_role, generation=generation_role,
              rollout=rollout_role)
EVAL_ROLES = Roles(master=eval_master_role, model=model_role, generation=generation_role,
                   rollout=rollout_role)
"""``mode=eval``: the master evaluates the trial's checkpoints; only the generation servers run
beside it (no model or rollout workers are started)."""


def arith_tiny() -> RLExperimentConfig:
    """GRPO, asynchronous, on one-digit sums with a tiny random-init Qwen2 (learns in minutes on
    2 cores)."""
    cfg = RLExperimentConfig()
    cfg.model.count, cfg.generation.count, cfg.rollout.count = 1, 1, 2
    cfg.rl.vllm.max_model_len = 128
    cfg.rl.vllm.kv_cache_gib = 0.25  # (tens of thousands of its 128-token sequences)
    return cfg


def smollm2_arith() -> RLExperimentConfig:
    """GRPO on arithmetic word problems with SmolLM2-135M-Instruct; held-out accuracy before and
    after."""
    cfg = RLExperimentConfig()
    cfg.model.count, cfg.generation.count, cfg.rollout.count = 1, 1, 2
    rl = cfg.rl
    # sized for a 2-core CPU (a 135M-parameter train step on ~1.5k tokens takes ~15 s there);
    # on GPUs raise total_steps, batch_size and max_new_tokens
    rl.total_steps, rl.batch_size, rl.group_size = 8, 4, 4
    rl.eval_interval = 4
    rl.actor = TorchEngineConfig(lr=2e-6, max_tokens_per_microbatch=2048)
    rl.task.name, rl.task.max_operand, rl.task.eval_size = "word", 20, 32
    rl.agent.max_new_tokens = 32
    rl.vllm.max_model_len = 512
    rl.tasks_per_request = 2
    return cfg


def same_layout(cfg: RLExperimentConfig, trial_dir: str) -> None:
    """A continued trial keeps the training layout its checkpoint is sharded by and the model
    it was trained from, and finds in it every model it trains."""
    checkpoints = os.path.join(trial_dir, "checkpoints")
    check_resume_layout(checkpoints, layout_of(cfg.rl.actor, cfg.model.count))
    check_resume_critic(checkpoints, cfg.rl.algorithm)
    check_resume_model(checkpoints, model_dir(cfg.rl, cfg.exp))


STATEFUL = ("model", "master")
ARITH_TINY = Experiment("arith-tiny", arith_tiny, ROLES, section="rl", stateful=STATEFUL,
                        warm=WARM, prepare=PREPARE, eval_roles=EVAL_ROLES,
                        eval_done=nothing_to_evaluate, resume_check=same_layout,
                        train_done=nothing_to_train)
SMOLLM2_ARITH = Experiment("smollm2-arith", smollm2_arith, ROLES, section="rl",
                           stateful=STATEFUL, warm=WARM, prepare=PREPARE, eval_roles=EVAL_ROLES,
                           eval_done=nothing_to_evaluate, resume_check=same_layout,
                           train_done=nothing_to_train)
