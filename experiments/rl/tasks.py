"""Tasks: where prompts come from and how completions are scored.

A prompt is ``{"id", "prompt", "answer"}``. A :class:`Task` is what a task factory returns for
the ``rl.task`` section (:class:`TaskConfig`): its train / held-out prompts and its reward.
``rl.task.name`` picks the factory: a built-in (:data:`TASKS`) or a plugin an installed package
declares under the ``slurm_rl.tasks`` entry-point group (:mod:`experiments.rl.plugins`).
Prompt files (``rl.task.train_path`` / ``eval_path``: jsonl, parquet or a saved ``datasets``
directory, :mod:`experiments.rl.prompt_files`) replace a task's own prompts, and
``rl.task.reward`` its reward (:mod:`experiments.rl.rewards`).

Built in (:mod:`experiments.rl.synthetic`): ``arith`` (``"a+b="`` sums, answer first;
arith-tiny's character vocabulary) and ``word`` (word problems, last integer; SmolLM2's chat
format). Their held-out problems are never training problems.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any, Callable, TypeVar

from experiments.rl import plugins
from experiments.rl.prompt_files import INT64, load_prompts
from experiments.rl.rewards import ANSWER_CHECKS, REWARDS
from experiments.rl.synthetic import arith_task, word_task
from experiments.rl.task_api import Prompt, Task, TaskConfig, TaskFactory
from system.errors import ConfigError
from system.structs import plain

SPLITS = ("train", "eval")
T = TypeVar("T")

TASKS: dict[str, TaskFactory] = {"arith": arith_task, "word": word_task}
"""The built-in tasks, by the name ``rl.task.name`` takes."""

_BUILT: dict[str, Task] = {}


def get_task(cfg: TaskConfig) -> Task:
    """The task of ``cfg``, built once per process (with ``rl.task.reward`` applied)."""
    key = json.dumps(plain(cfg), sort_keys=True)
    if key not in _BUILT:
        factory = TASKS.get(cfg.name) or plugins.load(plugins.TASK_GROUP, "rl.task.name",
                                                      cfg.name)
        task = _call(cfg, f"the factory {_name(factory)}", factory, cfg)
        if not isinstance(task, Task):
            raise ConfigError(f"rl.task.name={cfg.name!r}: the factory returned "
                              f"{type(task).__name__}, not experiments.rl.tasks.Task")
        if cfg.reward:
            reward = REWARDS.get(cfg.reward) or plugins.load(plugins.REWARD_GROUP,
                                                             "rl.task.reward", cfg.reward)
            task = dataclasses.replace(task, reward=reward)
        _BUILT[key] = task
    return _BUILT[key]


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class EmptyPromptFile(ConfigError):
    """A prompt file the config names holds no prompts (seen where the file is read)."""


def _call(cfg: TaskConfig, what: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: a task's own code, deterministic in ``cfg`` (it runs in the master and in
    every rollout worker), so what it raises would be raised again by a restart: a
    :class:`ConfigError` naming ``rl.task.name``, not a failure to recover from."""
    try:
        with plugins.no_exit():
            return fn(*args)
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:300]  # (one line, as every config error)
        raise ConfigError(f"rl.task.name={cfg.name!r}: {what} raised {type(e).__name__}: "
                          f"{first}; valid: a task that builds with these rl.task settings "
                          "(rl.task.options included)") from e


def dataset(cfg: TaskConfig, split: str) -> list[Prompt]:
    """The prompts of ``split`` (``train`` or ``eval``): from the split's file if set, else the
    task's own."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")
    path = cfg.train_path if split == "train" else cfg.eval_path
    key = f"rl.task.{split}_path"
    if path and not os.path.exists(path):  # (the launcher's machine need not see it)
        raise ConfigError(f"{key}={path!r} does not exist on {socket.gethostname()} (valid: a "
                          "path every worker can read; the launcher makes a relative one "
                          "absolute against its own working directory)")
    if path:
        out = load_prompts(path, cfg.fields, cfg.train_split if split == "train"
                           else cfg.eval_split, key=key)
        if not out:  # (a file named and empty is a mistake: training's or evaluation's)
            raise EmptyPromptFile(f"{key}={path!r} holds no prompts; valid: a .jsonl file with "
                                  "one JSON object per line, or a parquet file or saved dataset "
                                  "with at least one row")
        _check_answers(cfg, f"{key}={path!r}", out)
        return out  # type: ignore[return-value]
    task = get_task(cfg)
    if task.prompts is None:
        if split == "eval":
            return []
        raise ConfigError(f"rl.task.name={cfg.name!r} has no prompts of its own: set "
                          "rl.task.train_path")
    out = _call(cfg, f"its prompts({split!r})", task.prompts, split)
    bad_prompt = (out if not isinstance(out, list) else next(
        (p for p in out if not isinstance(p, dict) or not {"id", "prompt", "answer"} <= set(p)
         or not isinstance(p["prompt"], str)), None))
    if bad_prompt is not None:  # (a rollout worker would fail on it, and its restarts too)
        raise ConfigError(f"rl.task.name={cfg.name!r}: its prompts({split!r}) gave "
                          f"{str(bad_prompt)[:80]!r}; valid: a list of {{'id': int, 'prompt': "
                          "str, 'answer': ...}} dicts")
    ids = [p["id"] for p in out]
    bad = next((i for i in ids if isinstance(i, bool) or not isinstance(i, int)
                or not INT64[0] <= i <= INT64[1]), None)
    if bad is not None:  # (tasks name their prompt by id on the wire)
        raise ConfigError(f"rl.task.name={cfg.name!r}: {split} prompt id {bad!r} is not a "
                          "64-bit integer; valid: integer ids from -2**63 to 2**63-1")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"rl.task.name={cfg.name!r}: {split} prompt ids repeat")
    if not out and split == "train":
        raise ConfigError(f"rl.task.name={cfg.name!r} gave no training prompts (with its "
                          "rl.task settings); valid: settings that give at least one, or "
                          "rl.task.train_path=FILE")
    _check_answers(cfg, f"rl.task.name={cfg.name!r}", out)
    return out


def _check_answers(cfg: TaskConfig, source: str, prompts: list[Any]) -> None:
    """Every answer is one the task's reward can compare with (``first_int`` and ``last_int``:
    an integer): a bad one stopped the trial mid-run, once a completion began with a digit."""
    reward = get_task(cfg).reward
    check = ANSWER_CHECKS.get(reward)
    if check is None:
        return
    for p in prompts:
        try:
            check(p["answer"])
        except ValueError as e:
            raise ConfigError(f"{source}: prompt id {p['id']}: {e}, which the reward "
                              f"{reward.__name__.removesuffix('_reward')} compares completions "
                              "with; valid: integer answers (whole numbers), or "
                              "rl.task.reward=math") from None


__all__ = ["EmptyPromptFile", "Prompt", "SPLITS", "TASKS", "Task", "TaskConfig", "TaskFactory",
           "dataset", "get_task"]
