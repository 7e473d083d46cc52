"""Task plugins: a prompt source and a reward function.

A prompt is ``{"id", "prompt", "answer"}``. Sources: a local ``.jsonl`` or ``.parquet`` file
with those columns (``id`` optional), or data a synthetic task generates from a seed. Rewards
are verifiable: the answer in the completion's text is compared with the prompt's ``answer``.

- ``arith``: ``"a+b="`` style sums with small operands; the answer is the integer the
  completion starts with (arith-tiny's character vocabulary).
- ``word``: arithmetic word problems in English; the answer is the last integer in the
  completion (SmolLM2's chat format).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from typing import Any, Callable, TypedDict

from system.errors import ConfigError


class Prompt(TypedDict):
    id: int
    prompt: str
    answer: Any


@dataclasses.dataclass
class TaskConfig:
    """The task: where prompts come from and how completions are scored."""

    name: str = "arith"
    """Task plugin: arith (``a+b=``, answer first) or word (word problems, last number)."""
    train_path: str = ""
    """A local .jsonl or .parquet file of training prompts (empty: generated)."""
    eval_path: str = ""
    """A local .jsonl or .parquet file of held-out prompts (empty: generated)."""
    train_size: int = 4096
    """Generated training prompts (one epoch)."""
    eval_size: int = 64
    """Generated held-out prompts (disjoint from the training ones)."""
    max_operand: int = 4
    """Operands are drawn from 0..max_operand."""
    ops: str = "+"
    """Operators used by generated problems (any of + - *)."""
    seed: int = 0
    """Seed of the generated data."""

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ConfigError(f"name={self.name!r} is not one of {sorted(TASKS)}")
        if self.train_size < 1 or self.eval_size < 0 or self.max_operand < 1:
            raise ConfigError("train_size >= 1, eval_size >= 0 and "
                              "rl.task.max_operand >= 1 are required")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ConfigError(f"ops={self.ops!r} must be made of + - *")
        for key in ("train_path", "eval_path"):
            path = getattr(self, key)
            if path and not (path.endswith(".jsonl") or path.endswith(".parquet")):
                raise ConfigError(f"{key}={path!r} must be a .jsonl or .parquet file")


def load_prompts(path: str) -> list[Prompt]:
    """Prompts from a local jsonl or parquet file (columns ``prompt``, ``answer``, ``id``)."""
    if not os.path.isfile(path):
        raise ConfigError(f"prompt file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    out = []
    for i, r in enumerate(rows):
        if "prompt" not in r or "answer" not in r:
            raise ConfigError(f"{path}: row {i} lacks 'prompt' or 'answer'")
        pid = r.get("id")
        out.append({"id": int(i if pid is None else pid), "prompt": str(r["prompt"]),
                    "answer": r["answer"]})
    return out


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _problems(cfg: TaskConfig) -> list[tuple[int, str, int]]:
    return [(a, op, b) for a in range(cfg.max_operand + 1) for op in cfg.ops
            for b in range(cfg.max_operand + 1)]


def arith_prompts(cfg: TaskConfig, split: str) -> list[Prompt]:
    """``train``: ``train_size`` draws from all problems; ``eval``: the same problems in a fixed
    order (a tiny vocabulary has no room for unseen problems; the held-out set measures accuracy
    under greedy decoding, not generalisation)."""
    probs = _problems(cfg)
    rng = random.Random(cfg.seed + (0 if split == "train" else 1))
    size = cfg.train_size if split == "train" else cfg.eval_size
    picks = [probs[rng.randrange(len(probs))] for _ in range(size)]
    return [{"id": i, "prompt": f"{a}{op}{b}=", "answer": _apply(a, op, b)}
            for i, (a, op, b) in enumerate(picks)]


_WORD = [
    ("{n} has {a} apples and buys {b} more. How many apples does {n} have now?", "+"),
    ("{n} had {a} marbles and lost {b}. How many marbles are left?", "-"),
    ("{n} packs {a} boxes with {b} pens each. How many pens are there in total?", "*"),
    ("A shelf holds {a} books. {n} adds {b} books. How many books are on the shelf?", "+"),
    ("{n} baked {a} cookies and gave away {b}. How many cookies remain?", "-"),
]
_NAMES = ["Tom", "Ana", "Li", "Sara", "Omar", "Kim", "Ravi", "Eva"]


def word_prompts(cfg: TaskConfig, split: str) -> list[Prompt]:
    """Word problems; the held-out split uses disjoint (template, a, b) triples."""
    rng = random.Random(cfg.seed)
    triples = [(t, a, b) for t in range(len(_WORD)) for a in range(1, cfg.max_operand + 1)
               for b in range(1, cfg.max_operand + 1) if _WORD[t][1] != "-" or a >= b]
    rng.shuffle(triples)
    held = triples[:max(1, min(cfg.eval_size, len(triples) // 4))]
    pool = triples[len(held):] if split == "train" else held
    size = cfg.train_size if split == "train" else len(held)
    out = []
    for i in range(size):
        t, a, b = pool[i % len(pool)] if split == "eval" else pool[rng.randrange(len(pool))]
        text, op = _WORD[t]
        name = _NAMES[(a * 7 + b + t) % len(_NAMES)]
        out.append({"id": i, "prompt": text.format(n=name, a=a, b=b) +
                    " Answer with the number.", "answer": _apply(a, op, b)})
    return out


_INT = re.compile(r"-?\d+")


def first_int_reward(completion: str, answer: Any) -> float:
    """1 if the completion starts with the answer as an integer (``"7"``, ``"7 "``), else 0."""
    m = re.match(r"\s*(-?\d+)", completion)
    return float(m is not None and int(m.group(1)) == int(answer))


def last_int_reward(completion: str, answer: Any) -> float:
    """1 if the last integer in the completion is the answer, else 0."""
    found = _INT.findall(completion.replace(",", ""))
    return float(bool(found) and int(found[-1]) == int(answer))


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    make_prompts: Callable[[TaskConfig, str], list[Prompt]]
    reward: Callable[[str, Any], float]
    chat: bool
    """Prompts go through the tokenizer's chat template."""


TASKS: dict[str, Task] = {
    "arith": Task("arith", arith_prompts, first_int_reward, chat=False),
    "word": Task("word", word_prompts, last_int_reward, chat=True),
}


def get_task(cfg: TaskConfig) -> Task:
    return TASKS[cfg.name]


def dataset(cfg: TaskConfig, split: str) -> list[Prompt]:
    path = cfg.train_path if split == "train" else cfg.eval_path
    return load_prompts(path) if path else get_task(cfg).make_prompts(cfg, split)
