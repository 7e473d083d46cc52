"""The task plugin interface: the ``rl.task`` section a task factory receives
(:class:`TaskConfig`) and the :class:`Task` it returns. :mod:`experiments.rl.tasks` picks and
runs the factory."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Protocol, TypedDict

from experiments.rl import plugins
from experiments.rl.prompt_files import check_path, parse_fields
from experiments.rl.rewards import REWARDS, RewardFn
from system.errors import ConfigError

BUILTIN_TASKS = ("arith", "word")
"""The tasks :mod:`experiments.rl.synthetic` generates."""


class Prompt(TypedDict):
    id: int
    prompt: str
    answer: Any


@dataclasses.dataclass
class TaskConfig:
    """The task: where prompts come from and how completions are scored."""

    name: str = "arith"
    """Task: arith (``a+b=``, answer first), word (word problems, last number), or a plugin an
    installed package declares under the ``slurm_rl.tasks`` entry-point group, by its name or
    its ``module:factory`` value."""
    reward: str = ""
    """Reward instead of the task's own (empty: the task's): first_int, last_int, math (the last
    ``\\boxed{}`` or number, compared as numbers: 1,000 = 1000.0, 3/4 = \\frac{3}{4}), or a
    plugin under the ``slurm_rl.rewards`` entry-point group."""
    train_path: str = ""
    """Training prompts from a local .jsonl or .parquet file or a directory saved by datasets'
    ``save_to_disk`` (empty: the task's own)."""
    eval_path: str = ""
    """Held-out prompts, like train_path (empty: the task's own; none if the task has none)."""
    fields: str = ""
    """Columns of the prompt files per field, ``prompt:COL,answer:COL,id:COL`` (a field not
    named reads the column of its own name; id is optional)."""
    train_split: str = "train"
    """The split train_path is read from when it is a saved DatasetDict."""
    eval_split: str = "test"
    """The split eval_path is read from when it is a saved DatasetDict."""
    train_size: int = 4096
    """Generated training prompts (one epoch)."""
    eval_size: int = 64
    """At most this many generated held-out prompts (disjoint from the training problems)."""
    max_operand: int = 4
    """Operands are drawn from 0..max_operand."""
    ops: str = "+"
    """Operators used by generated problems (any of + - *)."""
    seed: int = 0
    """Seed of the generated data."""
    options: Dict[str, str] = dataclasses.field(default_factory=dict)
    """A plugin's own settings, a map (``rl.task.options={level: 3}``); built-ins take none."""
    reward_timeout: float = 300.0
    """Seconds one call of the reward function may run (0: no limit); one still running then
    stops the trial in one line naming it (a call cannot be interrupted)."""

    def __post_init__(self) -> None:
        plugins.check(plugins.TASK_GROUP, "name", self.name, list(BUILTIN_TASKS))
        if self.reward:
            plugins.check(plugins.REWARD_GROUP, "reward", self.reward, sorted(REWARDS))
        if not 0 <= self.reward_timeout < float("inf"):
            raise ConfigError(f"reward_timeout must be >= 0 seconds (0: no limit), got "
                              f"{self.reward_timeout}")
        for key, least in (("train_size", 1), ("eval_size", 0), ("max_operand", 1)):
            if getattr(self, key) < least:
                raise ConfigError(f"{key} must be >= {least}, got {getattr(self, key)}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(f"ops={self.ops!r} must be made of + - *")
        for key in ("train_path", "eval_path"):
            check_path(key, getattr(self, key))
        parse_fields(self.fields)
        if self.name in BUILTIN_TASKS and self.options:
            raise ConfigError(f"options={dict(self.options)}: the built-in task {self.name!r} "
                              "takes none")


@dataclasses.dataclass(frozen=True)
class Task:
    """What a task factory returns."""

    name: str
    prompts: Optional[Callable[[str], "list[Prompt]"]]
    """``prompts(split)`` for split ``train`` or ``eval``: the task's own prompts (ids unique
    within a split), or None for a task whose prompts come from files only."""
    reward: RewardFn
    """``reward(completion text, the prompt's answer) -> float`` in [0, 1]."""
    chat: bool = False
    """Prompts go through the tokenizer's chat template."""


class TaskFactory(Protocol):
    """A task plugin: builds the task for the validated ``rl.task`` section (its ``options``
    hold the plugin's own settings). Called once per process that needs the task (the master
    and each rollout worker), so it must be deterministic in ``cfg``."""

    def __call__(self, cfg: TaskConfig) -> Task: ...


