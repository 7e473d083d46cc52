"""results.jsonl: which checkpoints an evaluation run still has to do, and the rewrite."""
from __future__ import annotations

import json
import os

from experiments.rl.config import RLConfig
from experiments.rl.eval_results import (eval_set_id, merged, pending, plot_accuracy,
                                         read_results, write_results)


def _row(step: int, cid: str = "a", eval_set: str = "e", acc: float = 0.5) -> dict:
    return {"step": step, "accuracy": acc, "checkpoint_id": cid, "eval_set": eval_set}


def test_pending_skips_only_the_same_weights_on_the_same_set():
    rows = [_row(2), _row(4, cid="old"), _row(6, eval_set="other")]
    # step 4 was replaced by a resumed training, step 6 was measured on another set,
    # step 8 is new; step 0's line (a pruned checkpoint) does not matter
    assert pending(rows, [(2, "a"), (4, "new"), (6, "a"), (8, "a")], "e") == [4, 6, 8]
    assert pending(rows, [(2, "a")], "e") == []


def test_merged_replaces_the_line_of_its_step_and_keeps_pruned_ones(tmp_path):
    rows = [_row(0), _row(4, acc=0.1)]
    out = merged(rows, _row(4, acc=0.9))
    out = merged(out, _row(2, acc=0.3))
    assert [(r["step"], r["accuracy"]) for r in out] == [(0, 0.5), (2, 0.3), (4, 0.9)]
    path = str(tmp_path / "results.jsonl")
    write_results(path, out)
    assert read_results(path) == out
    assert [json.loads(line)["step"] for line in open(path)] == [0, 2, 4]
    assert read_results(str(tmp_path / "absent.jsonl")) == []
    png = plot_accuracy(out, str(tmp_path / "accuracy.png"), "t")
    assert os.path.getsize(png) > 1000


def test_eval_set_follows_the_task_and_agent_only():
    a, b = RLConfig(), RLConfig()
    b.total_steps, b.actor.lr = 3, 1.0
    assert eval_set_id(a) == eval_set_id(b)
    b.task.eval_size += 1
    assert eval_set_id(a) != eval_set_id(b)
