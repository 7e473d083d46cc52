"""Configuration of the RL experiments (``arith-tiny``, ``smollm2-arith``): the ``rl`` section."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

from experiments.rl.agents import AgentConfig
from experiments.rl.algorithms.objectives import ActorLossConfig
from experiments.rl.algorithms.overlong import OverlongConfig
from experiments.rl.tasks import TaskConfig, dataset
from scheduler.config import SchedulerKind
from scheduler.gpu_plan import GpuDemand
from system.paths import PROJECT_ROOT
from system.launcher.config import ExperimentConfig, RecoverConfig, RunMode
from system.errors import ConfigError
from workers.engines.configs import TorchEngineConfig
from workers.engines.vllm_config import cpu_tensor_parallel_problem, memory_nodes
from workers.engines.vllm_memory import kv_cache_over_machine, kv_cache_under_one_sequence, \
    machine_memory
from workers.engines.vllm_server import VllmConfig


MAX_WAIT_S = 1e9
"""The longest timeout a key takes (about 31 years): Python's waits overflow past 9.2e9 s."""


def check_seconds(key: str, value: float) -> None:
    """A timeout: seconds > 0 (0 would fail every wait at once), at most :data:`MAX_WAIT_S`."""
    if not 0 < value <= MAX_WAIT_S:
        raise ConfigError(f"{key}={value} is not valid; valid: seconds > 0 and <= {MAX_WAIT_S:g}")


@dataclasses.dataclass
class WeightSyncConfig:
    """How new weights reach the generation servers."""

    mode: str = "fast"
    """fast (each vLLM rank receives its own shards in place), load_weights (full tensors over
    the group, through vLLM's loader) or disk (the trainer writes safetensors under the trial
    directory, the servers load them: the fallback when no group can form)."""
    bucket_mb: int = 256
    """Flat bucket size of the resharding executor (MiB)."""
    timeout: float = 300.0
    """Seconds a weight-update group waits for its members (> 0)."""

    def __post_init__(self) -> None:
        if self.mode not in ("fast", "load_weights", "disk"):
            raise ConfigError(f"mode={self.mode!r} is not one of fast, load_weights, "
                              "disk")
        if self.bucket_mb < 1:
            raise ConfigError(f"bucket_mb must be >= 1 (MiB), got {self.bucket_mb}")
        check_seconds("timeout", self.timeout)


@dataclasses.dataclass
class RLConfig:
    """The RL loop."""

    model_path: str = ""
    """Local Hugging Face checkpoint of the policy (empty: the experiment's model under .models/)."""
    algorithm: str = "grpo"
    """grpo (group-normalised rewards, no critic) or ppo (critic + GAE)."""
    mode: str = "async"
    """async (rollouts run continuously, bounded staleness) or sync (generate, then train)."""
    total_steps: int = 160
    """Training steps of the run."""
    batch_size: int = 16
    """B: prompts per training step (each with group_size samples)."""
    group_size: int = 8
    """n: samples per prompt."""
    group_std_norm: bool = True
    """grpo: divide each group's centred rewards by the group's standard deviation; false: the
    centred rewards as they are (Dr. GRPO: no bias toward groups of nearly equal rewards)."""
    dynamic_sampling: bool = False
    """grpo: drop a group whose rewards are all equal as it arrives (its advantages are all 0:
    no learning signal) and sample other prompts in its place, so every step trains on
    ``batch_size`` groups that carry one (DAPO). Its prompt comes again in the next epoch.
    Metrics: filtered_groups; rollout_reward (every arriving group's: a filtered batch's
    reward leaves the groups all right or all wrong out)."""
    max_filtered_batches: int = 10
    """dynamic_sampling: once this many batches' worth of groups were filtered while one
    step's batch filled, the rest of it takes groups as they come, with a warning (the task
    is nearly solved, or out of reach; 0: no limit)."""
    ppo_minibatches: int = 1
    """Optimizer steps per training step: the batch's groups split into this many mini-batches,
    one step each (the ratio then moves away from 1 and the clips act on the later ones; with
    one, the clips act only where the ratio's anchor is the behaviour policy)."""
    max_head_offpolicyness: int = 1
    """eta: the largest number of versions a trained sample's weights may lag (async mode)."""
    sync_interval: int = 1
    """Publish new weights to the generation servers every this many steps."""
    decoupled_loss: bool = True
    """Async mode: decoupled PPO objective with proximal log-probs recomputed by the trainer."""
    eval_interval: int = 40
    """Evaluate on the held-out set every this many steps (0: only before and after)."""
    eval_samples: int = 1
    """k: answers per held-out prompt; eval_accuracy is their mean reward (avg@k) and, with
    k > 1, eval_pass_at_k the mean of each prompt's best (pass@k for 1/0 rewards)."""
    eval_temperature: float = 0.0
    """Sampling temperature of the evaluation (0: greedy; k > 1 needs > 0; top_p 1). Sampled
    answers are seeded per prompt: an evaluation of the same weights repeats."""
    save_interval: int = 0
    """Checkpoint every this many steps (0: by time only, see save_interval_s)."""
    save_interval_s: float = 60.0
    """Also checkpoint once this many seconds have passed since the last checkpoint (0: by steps
    only), so a crash loses about this much training at most."""
    save_overhead: float = 0.05
    """Also checkpoint as often as keeps checkpointing under this fraction of the loop's time:
    after a checkpoint that took c seconds the next is due c / save_overhead seconds later, so
    a cheap checkpoint (a small model) is frequent and a crash loses few steps (0: off)."""
    lease_timeout: float = 300.0
    """Seconds a rollout task may stay out (its lease): then its admission slot is released and
    its prompt handed out again, keeping its epoch."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (0: every one). ``mode=eval`` evaluates the ones on
    disk: to evaluate every checkpoint of a run, raise this, or set 0."""
    tasks_per_request: int = 4
    """Prompts a rollout worker takes from the master at once (its calls share the batch)."""
    gamma: float = 1.0
    """PPO: discount, in [0, 1]."""
    lam: float = 1.0
    """PPO: GAE lambda, in [0, 1]."""
    value_clip: float = 0.2
    """PPO: value clipping of the critic loss, > 0 (a value moves at most this far from the
    old one)."""
    critic_lr: float = 1e-4
    """PPO: critic learning rate, > 0."""
    seed: int = 1
    """Seed of the prompt order and of the master's sampling, in [0, 2**32)."""
    startup_timeout: float = 600.0
    """Seconds to wait for engines to load, > 0 (vLLM starts in about a minute on 2 cores)."""
    call_timeout: float = 900.0
    """Seconds a train / log-prob / weight-sync / generation call may take, > 0."""
    crash_at_step: int = 0
    """Fault injection: the master fails right after this step (0: never); for resume tests."""
    actor: TorchEngineConfig = dataclasses.field(
        default_factory=lambda: TorchEngineConfig(lr=5e-4, max_tokens_per_microbatch=4096))
    """The policy's training engine (model_path comes from rl.model_path)."""
    loss: ActorLossConfig = dataclasses.field(default_factory=ActorLossConfig)
    """The policy objective."""
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    """Completions cut at rl.agent.max_new_tokens: DAPO's soft punishment and filtering."""
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    """Prompts and rewards."""
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    """How rollouts run."""
    vllm: VllmConfig = dataclasses.field(default_factory=VllmConfig)
    """The generation servers' engines."""
    weight_sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    """Trainer -> generation server weight updates."""

    def __post_init__(self) -> None:
        if self.algorithm not in ("grpo", "ppo"):
            raise ConfigError(f"algorithm={self.algorithm!r} is not one of grpo, ppo")
        if self.mode not in ("async", "sync"):
            raise ConfigError(f"mode={self.mode!r} is not one of async, sync")
        for key in ("total_steps", "batch_size", "group_size", "sync_interval",
                    "tasks_per_request"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_head_offpolicyness", "eval_interval", "save_interval", "crash_at_step",
                    "save_interval_s", "keep_checkpoints"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {getattr(self, key)}")
        if not 0 <= self.save_overhead < 1:
            raise ConfigError(f"save_overhead must be in [0, 1), got {self.save_overhead}")
        for key in ("lease_timeout", "startup_timeout", "call_timeout"):
            check_seconds(key, getattr(self, key))
        self._check_ppo()
        if not 0 <= self.seed < 1 << 32:
            raise ConfigError(f"seed must be in [0, 2**32) (numpy is seeded with it), got "
                              f"{self.seed}")
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ConfigError("group_size must be >= 2 for grpo (advantages are relative)")
        if self.dynamic_sampling and self.algorithm != "grpo":
            raise ConfigError("dynamic_sampling=true needs rl.algorithm=grpo (with ppo a group "
                              "of equal rewards still has advantages, from the critic)")
        if not self.group_std_norm and self.algorithm != "grpo":
            raise ConfigError("group_std_norm=false needs rl.algorithm=grpo (ppo whitens its "
                              "advantages over the batch)")
        if self.max_filtered_batches < 0:
            raise ConfigError(f"max_filtered_batches must be >= 0 (0: no limit), got "
                              f"{self.max_filtered_batches}")
        if not 1 <= self.ppo_minibatches <= self.batch_size:
            raise ConfigError(f"ppo_minibatches={self.ppo_minibatches} is not valid; valid: 1 "
                              f"to rl.batch_size={self.batch_size} (each takes whole groups)")
        if self.ppo_minibatches == 1 and self.decoupled and (self.loss.clip_eps_high
                                                             or self.loss.dual_clip):
            key = "clip_eps_high" if self.loss.clip_eps_high else "dual_clip"
            raise ConfigError(
                f"loss.{key} acts on ratios away from 1, and the decoupled loss's ratio (to "
                "the proximal policy) is 1 when a batch takes one optimizer step; valid with "
                "rl.ppo_minibatches > 1 and rl.loss.proximal=recompute, or with "
                "rl.loss.proximal=off (the ratio to the behaviour policy, staleness included)")
        if self.ppo_minibatches > 1 and self.decoupled and self.loss.proximal == "forward":
            raise ConfigError(
                f"ppo_minibatches={self.ppo_minibatches} needs rl.loss.proximal=recompute "
                "(forward takes the proximal log-probs from each step's own forward: after "
                "the first mini-batch's step they are not the batch's proximal policy)")
        if self.sync_interval - 1 > self.eta and self.mode == "sync":
            raise ConfigError(
                f"sync_interval={self.sync_interval}: mode=sync trains on fresh samples only "
                "(its max_head_offpolicyness is 0, whatever is set): use rl.sync_interval=1, "
                f"or rl.mode=async with rl.max_head_offpolicyness >= {self.sync_interval - 1}")
        if self.sync_interval - 1 > self.eta:
            raise ConfigError(
                f"sync_interval={self.sync_interval} needs rl.max_head_offpolicyness >= "
                f"{self.sync_interval - 1} (samples between syncs would all be too stale)")
        self._check_context()
        self.overlong.check_budget(self.agent.max_new_tokens, self.agent.kind)
        self._check_eval()

    def _check_eval(self) -> None:
        if self.eval_samples < 1:
            raise ConfigError(f"eval_samples must be >= 1, got {self.eval_samples}")
        if not (self.eval_temperature >= 0 and self.eval_temperature < float("inf")):
            raise ConfigError(f"eval_temperature={self.eval_temperature} is not valid; valid: "
                              "0 (greedy) or a number > 0")
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ConfigError(f"eval_samples={self.eval_samples} needs rl.eval_temperature > 0 "
                              "(greedy answers to one prompt are all the same)")
        if self.agent.kind == "openai" and (self.eval_samples > 1 or self.eval_temperature):
            raise ConfigError("rl.eval_samples and rl.eval_temperature are not read with "
                              "rl.agent.kind=openai: the agent function samples as it does, "
                              "once per held-out prompt; valid: rl.eval_samples=1 "
                              "rl.eval_temperature=0")

    def _check_ppo(self) -> None:
        """The critic's and GAE's settings (read with ``algorithm=ppo`` only, checked always:
        a config is valid whichever algorithm it is switched to)."""
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{key}={getattr(self, key)} is not valid; valid: a number "
                                  "in [0, 1]")
        if self.value_clip <= 0:
            raise ConfigError(f"value_clip={self.value_clip} is not valid; valid: > 0 (the "
                              "critic's values move at most this far from the old ones)")
        if self.critic_lr <= 0:
            raise ConfigError(f"critic_lr={self.critic_lr} is not valid; valid: > 0")

    def _check_context(self) -> None:
        """A completion budget that leaves no room for a prompt in the servers' context would
        have every request refused (and every prompt skipped). An agent function
        (``agent.kind=openai``) asks for its own ``max_tokens``."""
        budget, context = self.agent.max_new_tokens, self.vllm.max_model_len
        if self.agent.kind != "openai" and budget >= context:
            raise ConfigError(f"rl.agent.max_new_tokens={budget} leaves no room for a prompt in "
                              f"rl.vllm.max_model_len={context} (prompt + completion tokens); "
                              "valid: rl.agent.max_new_tokens < rl.vllm.max_model_len")

    @property
    def decoupled(self) -> bool:
        """Whether the objective is decoupled PPO: async mode with ``decoupled_loss`` and
        ``loss.proximal`` not off."""
        return self.mode == "async" and self.decoupled_loss and self.loss.proximal != "off"

    @property
    def eta(self) -> int:
        """The staleness bound in force: 0 in sync mode."""
        return 0 if self.mode == "sync" else self.max_head_offpolicyness


@dataclasses.dataclass
class RLExperimentConfig(ExperimentConfig):
    """Root config of an RL experiment."""

    recover: RecoverConfig = dataclasses.field(default_factory=RecoverConfig)
    """Continuing a trial and recovering from failures (``recover=auto|resume|off``)."""
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    """The RL loop."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model.count < 1 or self.generation.count < 1 or self.rollout.count < 1:
            raise ConfigError("RL needs model.count, generation.count and rollout.count >= 1")
        if self.rl.agent.kind == "openai" and not self.generation.http:
            raise ConfigError("rl.agent.kind=openai runs its agent on the generation servers' "
                              "OpenAI endpoint: it needs generation.http=true")
        # the experiment's own model when rl.model_path is empty (the split is then checked
        # at launch, not after every worker started)
        hf = model_config(model_dir(self.rl, self.exp))
        self.rl.actor.check_layout(self.model.count, hf, key="rl.actor.megatron")
        if self.exp or self.rl.model_path:  # (not an experiment's defaults, set after)
            check_model_len(self.rl.vllm.max_model_len, hf)
            # (the smaller dtype where it depends on the device: the server checks its own)
            dtype = self.rl.vllm.dtype if self.rl.vllm.dtype != "auto" else "bfloat16"
            problem = kv_cache_under_one_sequence(self.rl.vllm, hf, dtype)
            if problem:
                raise ConfigError(problem)

    def recovery(self) -> RecoverConfig | None:
        """None for an evaluation (``mode=eval``): it is not recovered, and run again it skips
        the checkpoints it finished."""
        return self.recover if self.mode == RunMode.TRAIN else None

    def check_machine(self, environ: Mapping[str, str] = os.environ,
                      nodes: Sequence[int] | None = None) -> None:
        """Checks against the machine the launcher runs on, for a trial whose workers run here
        too (``scheduler=local``): a :class:`ConfigError` naming the key (a check against the
        machine: the launcher exits with code 1). A training's model must be a model directory
        here (:func:`resolve_model_path`), and its prompt files readable prompts here (read as
        the master reads them: a missing, malformed or empty one is refused at launch, not
        once the workers started).
        On CPU (``scheduler.local.gpus`` finds none), vLLM's CPU backend binds each of
        ``rl.vllm.tensor_parallel_size`` ranks to a NUMA node of its own (``nodes``: those this
        process may use, :func:`~workers.engines.vllm_config.memory_nodes` by default), and
        allocates the whole of an ``rl.vllm.kv_cache_gib`` KV cache at start."""
        if self.scheduler.type != SchedulerKind.LOCAL:
            return  # (Slurm's nodes are not this one: the generation server checks there)
        if self.mode == RunMode.TRAIN:  # (an evaluation reads the trial's checkpoints)
            resolve_model_path(self.rl, self.exp)  # a model the workers here can read
        for split in ("train", "eval") if self.mode == RunMode.TRAIN else ("eval",):
            if getattr(self.rl.task, f"{split}_path"):  # read here as the workers will
                dataset(self.rl.task, split)
        from scheduler.local import local_gpus

        on_gpu = bool(local_gpus(self.scheduler.local.gpus, environ).ids)
        problem = kv_cache_under_one_sequence(  # (in the dtype of this machine's engines)
            self.rl.vllm, model_config(model_dir(self.rl, self.exp)),
            self.rl.vllm.engine_args(on_gpu).dtype)
        if problem:
            raise ConfigError(problem)
        if on_gpu:
            return  # on GPUs tensor_parallel_size counts GPUs, which placement checks
        found = memory_nodes(environ) if nodes is None else nodes
        problem = cpu_tensor_parallel_problem(self.rl.vllm.tensor_parallel_size, found, environ,
                                              key="rl.vllm.tensor_parallel_size") \
            or kv_cache_over_machine(self.rl.vllm.kv_cache_gib, machine_memory(),
                                     self.generation.count * self.rl.vllm.tensor_parallel_size)
        if problem:
            raise ConfigError(problem)

    def gpu_demands(self) -> list[GpuDemand]:
        """One GPU per model worker, ``tensor_parallel_size`` per generation server. Model
        workers form one NCCL group: shared GPUs (``scheduler.local.share_gpus``) may hold a
        model worker and generation servers, never two model workers."""
        return [GpuDemand("model", self.worker_counts()["model"], 1, "model.count",
                          exclusive=True),
                GpuDemand("generation", self.generation.count,
                          self.rl.vllm.tensor_parallel_size,
                          "generation.count x rl.vllm.tensor_parallel_size")]


DEFAULT_MODEL = {"arith-tiny": "arith-tiny", "smollm2-arith": "smollm2-135m-instruct"}
"""The model under ``.models/`` each experiment trains when ``rl.model_path`` is empty."""


def model_config(path: str) -> dict | None:
    """The ``config.json`` of the model at ``path`` (None when it is not given or not there:
    the engine checks again once the path is resolved)."""
    cfg = os.path.join(path, "config.json") if path else ""
    if not cfg or not os.path.isfile(cfg):
        return None
    with open(cfg) as f:
        return json.load(f)


def check_model_len(max_model_len: int, hf: Mapping[str, Any] | None,
                    environ: Mapping[str, str] = os.environ) -> None:
    """The servers' context must fit the model's positions (vLLM refuses it at every start of
    a generation server, in a long validation traceback). Left to vLLM: a model whose positions
    scale (``rope_scaling``, or transformers 5's ``rope_parameters`` with a ``rope_type`` other
    than ``default``), or ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` (vLLM's own override)."""
    hf = hf or {}
    limit = hf.get("max_position_embeddings")
    rope = hf.get("rope_parameters")
    scaled = bool(hf.get("rope_scaling")) or (isinstance(rope, Mapping) and rope.get(
        "rope_type", "default") != "default")
    allowed = environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "").lower() in ("1", "true")
    if isinstance(limit, int) and not scaled and not allowed and max_model_len > limit:
        raise ConfigError(f"rl.vllm.max_model_len={max_model_len} is longer than the model's "
                          f"context (max_position_embeddings={limit} in its config.json); "
                          f"valid: rl.vllm.max_model_len <= {limit}")


def model_dir(rl: RLConfig, experiment: str) -> str:
    """``rl.model_path``, or the experiment's own model under ``.models/`` when it is empty."""
    return rl.model_path or os.path.join(PROJECT_ROOT, ".models",
                                         DEFAULT_MODEL.get(experiment, "arith-tiny"))


def resolve_model_path(rl: RLConfig, experiment: str) -> str:
    path = model_dir(rl, experiment)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"rl.model_path={path!r} is not a model directory (no config.json; "
                          + ("valid: a Hugging Face model directory, or a checkpoint's actor/)"
                             if rl.model_path else "run `make setup`, which creates the "
                             "experiment models under .models/)"))
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ConfigError(f"rl.model_path={path!r} has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)}): copy the base model's tokenizer "
                          "files into it (checkpoints written by older versions have none)")
    return os.path.abspath(path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A Hugging Face tokenizer's files: a model directory holds at least one of them."""
