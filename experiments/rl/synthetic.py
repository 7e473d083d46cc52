"""The built-in tasks, generated from a seed: ``arith`` and ``word``.

Both split their problems once: the held-out problems (at most ``eval_size``, about a quarter
of all) are never drawn for training, so evaluation measures what the policy does on problems
it was not trained on.
"""
from __future__ import annotations

import functools
import random

from experiments.rl.rewards import first_int_reward, last_int_reward
from experiments.rl.task_api import Prompt, Task, TaskConfig


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def held_out_count(problems: int, eval_size: int) -> int:
    """How many of ``problems`` are held out: a quarter, at most ``eval_size``, and at least one
    when there is an evaluation at all (never every problem)."""
    if eval_size == 0 or problems < 2:
        return 0
    return max(1, min(eval_size, problems // 4))


def split_problems(problems: list, cfg: TaskConfig, split: str) -> list:
    """The training or the held-out part of ``problems`` (a seeded shuffle, then a cut)."""
    order = list(problems)
    random.Random(cfg.seed).shuffle(order)
    held = held_out_count(len(order), cfg.eval_size)
    return order[held:] if split == "train" else order[:held]


def arith_problems(cfg: TaskConfig) -> list[tuple[int, str, int]]:
    return [(a, op, b) for a in range(cfg.max_operand + 1) for op in cfg.ops
            for b in range(cfg.max_operand + 1)]


def arith_prompts(cfg: TaskConfig, split: str) -> list[Prompt]:
    """``train``: ``train_size`` draws from the training problems; ``eval``: each held-out
    problem once."""
    pool = split_problems(arith_problems(cfg), cfg, split)
    if split == "train":
        rng = random.Random(cfg.seed + 1)
        pool = [pool[rng.randrange(len(pool))] for _ in range(cfg.train_size)]
    return [{"id": i, "prompt": f"{a}{op}{b}=", "answer": _apply(a, op, b)}
            for i, (a, op, b) in enumerate(pool)]


_WORD = [
    ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?", "+"),
    ("{n} had {a} marbles and lost {b}. How many marbles are left?", "-"),
    ("{n} packs {a} boxes with {b} pens each. How many pens are there in total?", "*"),
    ("A shelf holds {a} books. {n} adds {b} books. How many books are on the shelf?", "+"),
    ("{n} baked {a} cookies and gave away {b}. How many cookies remain?", "-"),
]
_NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Kim", "Ravi", "Eva"]


def word_problems(cfg: TaskConfig) -> list[tuple[int, int, int]]:
    return [(t, a, b) for t in range(len(_WORD)) for a in range(1, cfg.max_operand + 1)
            for b in range(1, cfg.max_operand + 1) if _WORD[t][1] != "-" or a >= b]


def word_prompts(cfg: TaskConfig, split: str) -> list[Prompt]:
    """Word problems; the held-out split uses disjoint (template, a, b) triples."""
    pool = split_problems(word_problems(cfg), cfg, split)
    if split == "train":
        rng = random.Random(cfg.seed + 1)
        pool = [pool[rng.randrange(len(pool))] for _ in range(cfg.train_size)]
    out: list[Prompt] = []
    for i, (t, a, b) in enumerate(pool):
        text, op = _WORD[t]
        name = _NAMES[(a * 7 + b + t) % len(_NAMES)]
        out.append({"id": i, "prompt": text.format(n=name, a=a, b=b) +
                    " Answer with the number.", "answer": _apply(a, op, b)})
    return out


def arith_task(cfg: TaskConfig) -> Task:
    return Task("arith", functools.partial(arith_prompts, cfg), first_int_reward, chat=False)


def word_task(cfg: TaskConfig) -> Task:
    return Task("word", functools.partial(word_prompts, cfg), last_int_reward, chat=True)
