"""An example task plugin: ``(a+b)*c=`` problems for arith-tiny's character vocabulary.

Install it next to the project (``pip install -e examples/task_plugin``), then::

    python -m system.launch exp=arith-tiny trial=paren rl.task.name=paren \
        rl.task.options='{max_operand: 3}'

The entry point in ``setup.cfg`` (group ``slurm_rl.tasks``) is what makes ``paren`` (or
``paren_task:make_task``) a valid ``rl.task.name``.
"""
from __future__ import annotations

import random

from experiments.rl.rewards import first_int_reward
from experiments.rl.task_api import Prompt, Task, TaskConfig


def _problems(top: int) -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in range(top + 1) for b in range(top + 1) for c in range(1, 3)]


def make_task(cfg: TaskConfig) -> Task:
    """The factory: ``rl.task.options.max_operand`` (default 3) bounds a and b; c is 1 or 2.
    Every fifth problem (after a seeded shuffle) is held out for evaluation."""
    top = int(cfg.options.get("max_operand", "3"))
    if not 1 <= top <= 9:
        raise ValueError(f"rl.task.options.max_operand={top} must be in 1..9")
    problems = _problems(top)
    random.Random(cfg.seed).shuffle(problems)
    held = problems[::5][:cfg.eval_size]
    train = [p for p in problems if p not in held]

    def prompts(split: str) -> list[Prompt]:
        if split == "train":
            rng = random.Random(cfg.seed + 1)
            pool = [train[rng.randrange(len(train))] for _ in range(cfg.train_size)]
        else:
            pool = held
        return [{"id": i, "prompt": f"({a}+{b})*{c}=", "answer": (a + b) * c}
                for i, (a, b, c) in enumerate(pool)]

    return Task("paren", prompts, first_int_reward, chat=False)


def exact_reward(completion: str, answer: object) -> float:
    """A reward plugin: the whole completion (spaces aside) is the answer, nothing more."""
    return float(completion.strip() == str(answer))
