"""The master of an evaluation run (``mode=eval``): every saved checkpoint of the trial, oldest
first, through the generation servers alone.

For each checkpoint that ``results.jsonl`` does not hold yet (:func:`~experiments.rl.eval_results.
pending`): every server loads the checkpoint's policy weights from disk as weights version
``step`` (the disk path of weight sync, reading ``checkpoints/step_<N>/actor/`` in place: nothing
of the trial is written), the master checks that every server reports that version, then runs
the held-out evaluation the training loop runs (greedy, or seeded samples with
``rl.eval_samples``: :func:`~experiments.rl.evaluate.evaluate`) and rewrites
``<trial>/eval/results.jsonl`` and ``accuracy.png``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from experiments.rl.checkpoint import CheckpointDir
from experiments.rl.checkpoint_weights import CheckpointFormatError, actor_dir
from experiments.rl.common import eval_prompts, load_tokenizer, model_path, reward_watch, \
    rl_config
from experiments.rl.config import RLConfig, RLExperimentConfig
from experiments.rl.data import Router
from experiments.rl.reward_watch import RewardWatch
from experiments.rl.eval_results import (PLOT, RESULTS, EvalResult, checkpoint_id, eval_set_id,
                                         merged, pending, plot_accuracy, read_results,
                                         write_results)
from experiments.rl.evaluate import evaluate
from experiments.rl.openai_agent import trial_agent
from experiments.rl.tasks import EmptyPromptFile, dataset
from system.errors import ConfigError
from workers.client import collect
from workers.generation import GenerationClient
from workers.master import MasterWorker
from workers.peers import PeerClients

log = logging.getLogger("rl-eval")


def eval_master_role(master: MasterWorker) -> dict[str, Any]:
    rl = rl_config(master)
    master.set_progress(phase="loading engines")
    peers = PeerClients(master.peers, lambda a: master.client(a, rl.call_timeout),
                        exclude=master.name)
    try:
        gens = wait_for_servers(master, peers, int(master.config["counts"]["generation"]),
                                rl.startup_timeout)
        return evaluate_checkpoints(master, rl, gens)
    finally:
        peers.close()


def wait_for_servers(master: MasterWorker, peers: PeerClients, n: int,
                     timeout: float) -> dict[int, GenerationClient]:
    """Every generation server, by index, once its engine answers."""
    deadline = time.monotonic() + timeout
    while True:
        peers.refresh()
        gens = peers.generation_servers()
        ready = []
        for g in gens:
            try:
                ready.append(g.engine_stats().result(5.0) is not None)
            except Exception:
                ready.append(False)
        if len(gens) == n and all(ready):
            return {int(g.name.rsplit("/", 1)[1]): g for g in gens}
        if master.stopping:
            raise RuntimeError("stopped while waiting for the generation servers")
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation servers not ready within {timeout:.0f}s "
                               f"({sum(ready)}/{n} ready)")
        time.sleep(0.5)


@dataclasses.dataclass(frozen=True)
class EvalPlan:
    """What an evaluation of a trial's checkpoints has to do."""

    steps: list[int]
    """Checkpoints that verify and hold policy weights, oldest first."""
    broken: dict[int, str]
    """Checkpoints skipped, with why."""
    rows: list[dict[str, Any]]
    """``results.jsonl`` as it is."""
    todo: list[int]
    """Steps of :attr:`steps` with no result for this checkpoint and evaluation set."""
    eval_set: str


def plan_evaluation(trial_root: str, eval_dir: str, rl: RLConfig) -> EvalPlan:
    """Read the trial's checkpoints and ``<eval_dir>/results.jsonl`` (nothing is written: a
    trial without a checkpoint directory has no step)."""
    rows = read_results(os.path.join(eval_dir, RESULTS))
    eval_set = eval_set_id(rl)
    if not os.path.isdir(os.path.join(trial_root, "checkpoints")):  # (CheckpointDir makes it)
        return EvalPlan([], {}, rows, [], eval_set)
    ckpt = CheckpointDir(os.path.join(trial_root, "checkpoints"))
    steps, broken = [], {}
    for step in sorted(ckpt.steps()):
        problem = ckpt.verify(step)
        if problem is None:
            try:
                actor_dir(ckpt.path(step), rl.actor.backend)
            except CheckpointFormatError as e:  # (no policy weights to load: skipped, named)
                problem = str(e)
        if problem is None:
            steps.append(step)
        else:
            broken[step] = problem
    todo = pending(rows, [(s, checkpoint_id(ckpt.path(s))) for s in steps], eval_set)
    return EvalPlan(steps, broken, rows, todo, eval_set)


def nothing_to_evaluate(cfg: RLExperimentConfig, trial_root: str, eval_dir: str) -> str | None:
    """``mode=eval`` before anything starts: one line saying every checkpoint of the trial in
    ``trial_root`` is already evaluated (``<eval_dir>/results.jsonl`` holds each for this
    evaluation set), or None when some checkpoint is left (or none verifies: the run itself
    says why). ConfigError (one line) when the task has no held-out prompts to evaluate on."""
    try:
        held_out = dataset(cfg.rl.task, "eval")
    except EmptyPromptFile:  # (seen here: it is empty wherever it is read)
        raise
    except Exception:  # (a file this machine does not see, a plugin that fails: the run says)
        held_out = None
    if held_out == []:
        raise ConfigError(no_held_out(cfg.rl))
    plan = plan_evaluation(trial_root, eval_dir, cfg.rl)
    if plan.todo or not plan.steps or not _plot_current(eval_dir):
        return None
    unreadable = "".join(f"; step_{s} is unreadable ({p}): not evaluated"
                         for s, p in sorted(plan.broken.items()))
    return (f"mode=eval: nothing to evaluate: every checkpoint of {cfg.exp}/{cfg.trial} "
            f"(steps {', '.join(map(str, plan.steps))}) is already in "
            f"{os.path.join(eval_dir, RESULTS)} (with {PLOT} beside it); delete a line of it "
            f"to evaluate that checkpoint again{unreadable}")


def no_held_out(rl: RLConfig) -> str:
    where = (f"rl.task.eval_path={rl.task.eval_path!r} holds none" if rl.task.eval_path else
             f"rl.task.eval_size={rl.task.eval_size}" if rl.task.eval_size == 0 else
             f"the task {rl.task.name!r} has none and rl.task.eval_path is not set")
    return (f"mode=eval: no held-out prompts to evaluate on ({where}); give some with "
            "rl.task.eval_size=N (generated tasks) or rl.task.eval_path=FILE")


def _plot_current(eval_dir: str) -> bool:
    """``accuracy.png`` exists and is no older than ``results.jsonl`` (a run stopped or failed
    between the two leaves it stale: then the run goes on, evaluates nothing and plots)."""
    try:
        return (os.stat(os.path.join(eval_dir, PLOT)).st_mtime
                >= os.stat(os.path.join(eval_dir, RESULTS)).st_mtime)
    except FileNotFoundError:
        return False


def evaluate_checkpoints(master: MasterWorker, rl: RLConfig,
                         gens: dict[int, GenerationClient]) -> dict[str, Any]:
    """Evaluate the checkpoints ``results.jsonl`` lacks; returns the run's summary."""
    source = master.boot.evaluated_dir
    out_dir = master.boot.trial_dir  # <trial>/eval
    ckpt = CheckpointDir(os.path.join(source, "checkpoints"))
    results_path, plot_path = os.path.join(out_dir, RESULTS), os.path.join(out_dir, PLOT)
    tok = load_tokenizer(model_path(master, rl))
    agent = trial_agent(rl.agent, tok, master.boot.trial_dir, rl.call_timeout)
    held_out = eval_prompts(rl, tok)
    watch = reward_watch(master, rl.task.reward_timeout)
    if not held_out:  # (the launcher refuses it first: see nothing_to_evaluate)
        raise ConfigError(no_held_out(rl))
    router = Router(len(gens))
    router.set_live(set(gens))
    plan = plan_evaluation(source, out_dir, rl)
    steps, broken, rows, todo, eval_set = (plan.steps, plan.broken, plan.rows, plan.todo,
                                           plan.eval_set)
    for step, problem in broken.items():
        log.warning("checkpoint %s is unreadable (%s): skipped", ckpt.path(step), problem)
    log.info("checkpoints %s: %d to evaluate, %d already in %s", steps, len(todo),
             len(steps) - len(todo), results_path)
    for i, step in enumerate(todo):
        master.set_progress(phase="evaluating", step=f"{i + 1}/{len(todo)}", version=step)
        # what the servers would load; not marked: an evaluation writes nothing of the trial
        problem = ckpt.check_content(step, under="actor", mark=False)
        if problem is not None:
            log.warning("checkpoint %s is corrupt (%s): skipped", ckpt.path(step), problem)
            broken[step] = f"corrupt: {problem}"
            continue
        result = evaluate_one(ckpt.path(step), step, rl, gens, tok, agent, router, held_out,
                              watch)
        result["eval_set"] = eval_set
        rows = merged(rows, result)
        write_results(results_path, rows)
        log.info("step %d: accuracy %.4f (%d prompts, %.1fs)", step, result["accuracy"],
                 result["n_prompts"], result["seconds"])
        if master.stopping:
            raise RuntimeError("stopped during the evaluation")
    plot_accuracy(rows, plot_path, f"{master.exp}/{master.trial}: held-out accuracy")
    evaluated = [s for s in todo if s not in broken]
    return {"summary": {"evaluated": evaluated, "skipped": [s for s in steps if s not in todo],
                        "unreadable": broken, "results": results_path, "plot": plot_path,
                        "warnings": [f"checkpoint {ckpt.path(s)} is unreadable ({p}): not "
                                     "evaluated" for s, p in broken.items()],
                        "accuracy": {int(r["step"]): r["accuracy"] for r in rows}}}


def evaluate_one(step_dir: str, step: int, rl: RLConfig, gens: dict[int, GenerationClient],
                 tok: Any, agent: Any, router: Router, held_out: list,
                 watch: RewardWatch | None = None) -> EvalResult:
    """Load checkpoint ``step_dir`` into every server as version ``step``, check that each
    serves it, and evaluate."""
    weights = actor_dir(step_dir, rl.actor.backend)
    t0 = time.monotonic()
    collect([g.load_weights_from_disk(weights, step) for g in gens.values()], rl.call_timeout)
    versions = {r: int(g.engine_stats().result(rl.call_timeout)["version"])
                for r, g in gens.items()}
    if any(v != step for v in versions.values()):
        raise RuntimeError(f"after loading {weights} the servers report weights versions "
                           f"{versions}, not {step}")
    t1 = time.monotonic()
    ev = evaluate(gens, rl, tok, agent, router, held_out, watch=watch)
    return {"step": step, "accuracy": float(ev.accuracy), "digest": ev.digest,
            "pass_at_k": ev.pass_at_k, "n_prompts": len(held_out),
            "seconds": time.monotonic() - t1, "load_seconds": t1 - t0, "checkpoint": weights,
            "checkpoint_id": checkpoint_id(step_dir), "eval_set": ""}
