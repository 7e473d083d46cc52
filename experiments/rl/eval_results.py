"""``<trial>/eval/results.jsonl`` and ``accuracy.png``: one line per evaluated checkpoint.

Re-running an evaluation skips a checkpoint whose line is already there for the same weights
and the same evaluation set (:func:`pending`): the line names the checkpoint by a fingerprint of
its ``meta.json`` (which lists every file with its size: a checkpoint that a resumed training
replaced at the same step differs) and the evaluation set by a fingerprint of the ``rl.task``
and ``rl.agent`` sections. Anything else is evaluated again and its line replaced. Lines of
checkpoints that training has since pruned stay: they are the history. The file is rewritten
whole (a fresh file renamed over it) after each checkpoint, so an interrupted evaluation keeps
what it finished.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Sequence, TypedDict

from experiments.rl.checkpoint import META
from experiments.rl.config import RLConfig
from experiments.rl.metrics import read_rows
from system import json_text

RESULTS = "results.jsonl"
PLOT = "accuracy.png"


class EvalResult(TypedDict):
    """One line of ``results.jsonl``."""

    step: int
    """The training step of the checkpoint (the weights version the servers reported)."""
    accuracy: float
    """Accuracy on the held-out prompts (mean reward: avg@k with ``rl.eval_samples`` k), in
    [0, 1] for 1/0 rewards."""
    digest: str
    """Fingerprint of the answers (:class:`~experiments.rl.evaluate.Evaluation`), as the
    training loop logs it with ``eval_accuracy`` in ``metrics.jsonl`` (``eval_digest``)."""
    pass_at_k: float | None
    """With ``rl.eval_samples`` k > 1: the mean of each prompt's best reward (None: k = 1)."""
    n_prompts: int
    seconds: float
    """Generation and scoring (weights loading not included)."""
    load_seconds: float
    """Loading the checkpoint's weights into every generation server."""
    checkpoint: str
    """The directory the servers loaded (``.../checkpoints/step_<N>/actor``)."""
    checkpoint_id: str
    """Fingerprint of the checkpoint's ``meta.json``."""
    eval_set: str
    """Fingerprint of the evaluation set (``rl.task``, ``rl.agent``)."""


def checkpoint_id(step_dir: str) -> str:
    with open(os.path.join(step_dir, META), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def eval_set_id(rl: RLConfig) -> str:
    text = json.dumps({"task": dataclasses.asdict(rl.task), "agent": dataclasses.asdict(rl.agent),
                       **({"samples": rl.eval_samples, "temperature": rl.eval_temperature,
                           "seed": rl.seed}
                          if rl.eval_samples > 1 or rl.eval_temperature else {})},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_results(path: str) -> list[dict[str, Any]]:
    return read_rows(path) if os.path.exists(path) else []


def pending(rows: Sequence[dict[str, Any]], checkpoints: Sequence[tuple[int, str]],
            eval_set: str) -> list[int]:
    """Steps of ``checkpoints`` (``(step, checkpoint_id)``) with no line in ``rows`` for the
    same checkpoint and evaluation set (pure)."""
    done = {(r.get("step"), r.get("checkpoint_id"), r.get("eval_set")) for r in rows}
    return [step for step, cid in checkpoints if (step, cid, eval_set) not in done]


def merged(rows: Sequence[dict[str, Any]], result: EvalResult) -> list[dict[str, Any]]:
    """``rows`` with ``result`` in place of any line of its step, by step (pure)."""
    out = [r for r in rows if r.get("step") != result["step"]] + [dict(result)]
    return sorted(out, key=lambda r: int(r["step"]))


def write_results(path: str, rows: Sequence[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(json_text.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def plot_accuracy(rows: Sequence[dict[str, Any]], path: str, title: str) -> str:
    """Accuracy against step (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    points = sorted((int(r["step"]), float(r["accuracy"])) for r in rows)
    if points:
        ax.plot(*zip(*points), "o-", color="tab:red", label="held-out accuracy")
        ax.legend(loc="lower right")
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
