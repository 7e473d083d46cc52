"""The RL experiment on a real Slurm (the single-node test cluster), preempted job by job: the
job of each RL worker kind in turn (generation, rollout, model, master) gets Slurm's preemption
warning (SIGUSR2) and requeues itself; the trial goes on by itself and ends at the same step."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from typing import Iterator

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import (REPO, launch_argv, metrics_rows, overridden, print_stacks,
                           read_summary)
from tests.scheduler.test_slurm_e2e import SLURM, job_of, squeue, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.slurm, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

SMALL = ["rl.batch_size=4", "rl.group_size=4", "rl.task.train_size=14", "rl.task.eval_size=8",
         "rl.eval_interval=0", "controller.progress=false", "rl.save_interval=0",
         "rl.save_interval_s=0", "rl.save_overhead=0", "recover.backoff=0.5"]


def _steps(root: str) -> list[int]:
    return [row["step"] for row in metrics_rows(root)]


def _status(root: str, trial: str) -> str | None:
    """The trial's summary status; None while it has none."""
    try:
        return read_summary(root, "arith-tiny", trial)["status"]
    except FileNotFoundError:
        return None


class _Stderr:
    """The launcher's stderr, read as it comes (what an operator sees)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.text += line

    def count(self, needle: str) -> int:
        return self.text.count(needle)

    def rejoined(self) -> set[str]:
        """Workers the controller reported as rejoined."""
        return {w for line in self.text.splitlines() if line.startswith("rejoined: ")
                for w in line[len("rejoined: "):].split(", ")}


@contextlib.contextmanager
def _rl_trial(slurm_cluster, root: str, trial: str, *args: str
              ) -> Iterator[tuple[subprocess.Popen, _Stderr]]:
    """An arith-tiny trial on the test Slurm (``args``: its own overrides), yielded with its
    stderr once it has trained step 2; the launcher is killed on the way out if it still runs."""
    trial_root = os.path.join(root, "arith-tiny", trial)
    proc = subprocess.Popen(launch_argv("exp=arith-tiny", f"trial={trial}",
                                        f"cluster.fileroot={root}", *args),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **slurm_cluster.env})
    err = _Stderr(proc)
    try:
        wait_for(lambda: proc.poll() is not None or max(_steps(trial_root), default=0) >= 2,
                 300, "step 2")
        assert proc.poll() is None, err.text[-4000:]
        yield proc, err
    finally:
        if proc.poll() is None:
            print_stacks(["exp=arith-tiny", f"trial={trial}", f"cluster.fileroot={root}"],
                         slurm_cluster.env)
            proc.kill()


def _until(proc: subprocess.Popen, err: _Stderr, cond, timeout: float, what: str) -> None:
    """``wait_for`` on a running trial: fails at once if the launcher ended, and either way with
    what the launcher printed (a CI failure is read from that alone)."""
    try:
        wait_for(lambda: proc.poll() is not None or cond(), timeout, what)
    except AssertionError:
        raise AssertionError(f"timed out waiting for {what}:\n{err.text[-6000:]}") from None
    assert proc.poll() is None, f"the trial ended waiting for {what}:\n{err.text[-6000:]}"


def _preempt(env: dict, kind: str) -> str:
    job = job_of(env, "arith-tiny", "preempt", kind)
    subprocess.run(["scancel", "--signal=USR2", job], check=True, env=env)
    return job


def _cancel(env: dict, root: str, trial: str) -> None:
    """``python -m system.ctl cancel`` of arith-tiny trial ``trial``, as an operator would."""
    subprocess.run([sys.executable, "-m", "system.ctl", "cancel", "exp=arith-tiny",
                    f"trial={trial}", f"cluster.fileroot={root}"], cwd=REPO, env=env,
                   capture_output=True, check=True)


SLOW_OK = ("controller.heartbeat_ttl=15",)
"""The whole trial runs beside other tests on a small machine, where slurmctld itself was seen
taking over 30 s to answer one scancel: a 3 s heartbeat expired on a restarted master that was
only slow, and its needless extra recovery failed the test. The preemptions here are detected
through the jobs' requeues, not heartbeats."""
STEPS = 120


def test_preempted_jobs_of_every_kind_continue_by_themselves(slurm_cluster, tmp_path):
    """USR2 to each RL job in turn, each once the trial is back from the previous one:
    - generation: the server stops, its job requeues, comes back, joins a fresh weight-sync
      group with the current weights (no restart of anything else);
    - rollout: both rollout workers stop, their job requeues, they rejoin and take tasks again
      (their leases are released);
    - model: the model worker asks for a checkpoint and stops once it is written; its job
      requeues, and the controller restarts the master and model worker from that checkpoint;
    - master: the master checkpoints and stops; the same recovery follows.
    A requeue is no failure: with ``recover.retries=1`` both are recovered. No step is lost,
    the trial completes its steps and leaves no job behind."""
    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "preempt")
    # steps run at up to ~5/s between preemptions, and each preemption waits for the previous
    # kind to be back (a loaded machine reacts seconds late): a CI run finished 60 steps before
    # the model's preemption landed; 120 leave the margin, at a few seconds' cost
    env = {**os.environ, **slurm_cluster.env}
    jobs = {}
    with _rl_trial(slurm_cluster, root, "preempt", f"rl.total_steps={STEPS}",
                   *overridden(SLURM, *SMALL, *SLOW_OK), "recover.retries=1") as (proc, err):
        jobs["generation"] = _preempt(env, "generation")
        master_log = os.path.join(trial_root, "logs", "master-0.log")
        _until(proc, err, lambda: "generation server 0 rejoined" in open(master_log).read(), 300,
               "the generation server to rejoin")
        jobs["rollout"] = _preempt(env, "rollout")
        _until(proc, err, lambda: {"rollout/0", "rollout/1"} <= err.rejoined(), 300,
               "the rollout workers to rejoin")
        for n, kind in enumerate(("model", "master"), start=1):
            step = max(_steps(trial_root), default=0)
            _until(proc, err, lambda: max(_steps(trial_root), default=0) > step, 300,
                   "a new step")
            jobs[kind] = _preempt(env, kind)
            _until(proc, err, lambda n=n: err.count("recovered: ") >= n, 300, f"{kind} recovery")
        proc.wait(timeout=400)
    assert proc.returncode == 0, err.text[-4000:]
    s = read_summary(root, "arith-tiny", "preempt")
    assert s["status"] == "completed" and s["steps"] == STEPS
    assert s["restarts"].get(jobs["generation"]) == 1, s["restarts"]
    assert s["restarts"].get(jobs["rollout"]) == 1, s["restarts"]
    model, master = s["recoveries"]
    for rec, worker in ((model, "model/0"), (master, "master/0")):
        assert rec["worker"] == worker and rec["stateful"] and "requeued" in rec["cause"], rec
        assert rec["requeued"], rec  # no retry drawn on: recover.retries=1 held both
        assert rec["steps_lost"] == 0 and rec["resumed_from"] == rec["failed_step"], rec
    with open(os.path.join(trial_root, "logs", "model-0.log")) as f:
        assert "checkpoint committed after SIGUSR2" in f.read()
    assert "generation/0" in err.rejoined()
    assert squeue(slurm_cluster.env, "arith-tiny", "preempt") == []


def test_a_real_preemption_with_a_grace_time_checkpoints_and_requeues(slurm_cluster, tmp_path):
    """Slurm itself preempts the trial: a job of the higher-tier partition ``urgent`` needs every
    GPU of the node, and the whole node (``--exclusive``); the test cluster preempts with
    ``PreemptMode=REQUEUE`` and a 30 s ``GraceTime``, as shared clusters do. Slurm sends the
    tasks SIGTERM, not the jobs' ``--signal`` (USR2), and would requeue a job only if it still
    ran when the grace ended. Each worker sees its job chosen for preemption (``PreemptTime``)
    and stops as on SIGUSR2: the master and model worker after a checkpoint, then each job
    requeues itself. Once the urgent job is done, the trial continues from that checkpoint, no
    step lost, and every worker is back; a few steps later it is cancelled (that a trial runs
    to its end after a stateful requeue is the test above's)."""
    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "grace")
    env = {**os.environ, **slurm_cluster.env}
    with _rl_trial(slurm_cluster, root, "grace", "rl.total_steps=100000",
                   *overridden(SLURM, *SMALL, *SLOW_OK), "recover.retries=1") as (proc, err):
        jobs = {k: job_of(env, "arith-tiny", "grace", k)
                for k in ("master", "model", "generation", "rollout")}
        subprocess.run(["sbatch", "-p", "urgent", "--exclusive", "--gres=gpu:4", "-o", "/dev/null",
                        "--wrap", "sleep 2"], capture_output=True, env=env, check=True)
        _until(proc, err, lambda: err.count("recovered: ") >= 1 and {
            "generation/0", "rollout/0", "rollout/1"} <= err.rejoined(), 400,
            "the trial back from the preemption, every worker with it")
        step = max(_steps(trial_root))
        _until(proc, err, lambda: max(_steps(trial_root)) > step + 2, 120, "more steps")
        _cancel(env, root, "grace")
        proc.wait(timeout=120)
    s = read_summary(root, "arith-tiny", "grace")
    assert s["status"] == "cancelled", err.text[-4000:]
    restarts = s["restarts"]
    assert restarts.get(jobs["generation"]) == restarts.get(jobs["rollout"]) == 1, restarts
    # the first stateful job seen requeued starts the recovery, which replaces the stateful
    # jobs: one whose own requeue had not come yet is cancelled (no restart of it is seen)
    for kind in ("master", "model"):
        assert s["jobs"][kind] != [jobs[kind]], (kind, jobs, s["jobs"])
        assert restarts.get(jobs[kind]) in (1, None), (kind, restarts, jobs)
    assert any(restarts.get(jobs[k]) == 1 for k in ("master", "model")), (restarts, jobs)
    assert set(restarts) <= set(jobs.values()), (restarts, jobs)
    (rec,) = s["recoveries"]
    assert rec["stateful"] and "requeued" in rec["cause"], rec
    assert rec["requeued"] and rec["steps_lost"] == 0, rec
    trained = [step for step in _steps(trial_root) if step > 0]
    assert trained == list(range(1, max(trained) + 1)), trained  # each step once, none lost
    for name in ("master-0", "model-0", "generation-0", "rollout-0", "rollout-1"):
        with open(os.path.join(trial_root, "logs", f"{name}.log")) as f:
            log = f.read()
        assert "got SIGTERM with its job chosen for preemption" in log, name
        assert "requeue of job" in log, name
        if name in ("master-0", "model-0"):
            assert "checkpoint committed after SIGUSR2" in log, name
    assert squeue(slurm_cluster.env, "arith-tiny", "grace") == []


DETACHED_STEPS = 60
"""Enough for the warning at step 3 to stop the trial well before its end (the master reads
the checkpoint request within a second, at about 5 steps a second here)."""


def test_a_detached_controller_at_its_time_limit_requeues_itself(slurm_cluster, tmp_path):
    """The --detach controller's job gets Slurm's time-limit warning (SIGUSR2 to its batch
    shell, as ``--signal=B:USR2`` sends it): it asks the master for a checkpoint, stops every
    worker and job, and requeues its own job; meanwhile the trial is ``requeued`` in its
    summary and ``pending`` to ``system.ctl``. When Slurm starts the job again, the trial
    continues from the checkpoint (started with ``recover=off``: resumed all the same) and
    completes, no step lost or trained twice, no job left."""
    import json
    import re

    from tests.helpers import run_launch

    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "ctl")
    env = {**os.environ, **slurm_cluster.env}
    r = run_launch("exp=arith-tiny", "trial=ctl", f"cluster.fileroot={root}",
                   f"rl.total_steps={DETACHED_STEPS}", *overridden(SLURM, *SMALL, *SLOW_OK),
                   "recover=off", "--detach", env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    job = re.search(r"as job (\d+)", r.stdout).group(1)
    try:
        wait_for(lambda: max(_steps(trial_root), default=0) >= 3, 300, "step 3")
        subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True, env=env)
        wait_for(lambda: _status(root, "ctl") == "requeued", 180, "the requeued summary")
        s = read_summary(root, "arith-tiny", "ctl")
        stopped_at = max(_steps(trial_root))
        # (the master trains no step after the checkpoint it was asked for)
        assert s["requeued"] == {"job": job, "checkpointed": True, "checkpoint_step": stopped_at,
                                 "last_step": stopped_at}, s

        def requeued():
            out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                                 text=True, env=env).stdout
            return "Restarts=1" in out and "JobState=PENDING" in out
        wait_for(requeued, 120, "the controller's job to requeue")
        with open(os.path.join(trial_root, "status.json")) as f:
            assert json.load(f)["state"] == "pending"
        status = subprocess.run(
            [sys.executable, "-m", "system.ctl", "status", "exp=arith-tiny", "trial=ctl",
             f"cluster.fileroot={root}"], cwd=REPO, capture_output=True, text=True, env=env)
        assert status.returncode == 0 and "pending" in status.stdout, status.stdout
        # Slurm holds a requeued job about two minutes (BeginTime): let it go now
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True,
                       env=env)
        # (the continued run removes the summary when it starts, and writes its own at the end)
        wait_for(lambda: _status(root, "ctl") not in (None, "requeued"), 500,
                 "the continued trial's end")
    finally:
        subprocess.run(["scancel", job], env=env)
    with open(os.path.join(trial_root, "logs", "controller.log")) as f:
        log = f.read()
    s = read_summary(root, "arith-tiny", "ctl")
    assert s["status"] == "completed" and s["steps"] == DETACHED_STEPS, log[-4000:]
    assert "started again (restart 1): the trial continues from its checkpoint" in log
    trained = [step for step in _steps(trial_root) if step > 0]
    assert trained == list(range(1, DETACHED_STEPS + 1)), (stopped_at, trained)
    with open(os.path.join(trial_root, "config.yaml")) as f:
        assert "recover:\n  type: RESUME\n" in f.read()  # (recover=off, continued)
    wait_for(lambda: squeue(slurm_cluster.env, "arith-tiny", "ctl") == [], 60, "an empty queue")


def test_a_preempted_detached_controller_requeues_itself_within_the_grace(slurm_cluster,
                                                                          tmp_path):
    """Slurm preempts the whole node (the ``urgent`` job, as above) while a --detach controller
    runs there. Its batch shell, the controller itself, would get SIGTERM only when the 30 s
    grace ends, with ``KillWait`` (5 s here) to stop every job: killed midway, it left the
    worker jobs, requeued meanwhile, to run on until their orphan timeout. It looks at its own
    job instead, sees it chosen for preemption within seconds, and takes its time-limit path
    well within the grace: every worker and job stopped, the trial ``requeued``, its own job
    requeued by itself (not cancelled by the preemption) and alone in the queue. (The trial's
    continuation from there is the time-limit test's.)"""
    import re

    from tests.helpers import run_launch

    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "pre")
    env = {**os.environ, **slurm_cluster.env}
    r = run_launch("exp=arith-tiny", "trial=pre", f"cluster.fileroot={root}",
                   f"rl.total_steps={STEPS}", *overridden(SLURM, *SMALL, *SLOW_OK), "--detach",
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    job = re.search(r"as job (\d+)", r.stdout).group(1)
    try:
        wait_for(lambda: max(_steps(trial_root), default=0) >= 2, 300, "step 2")
        subprocess.run(["sbatch", "-p", "urgent", "--exclusive", "--gres=gpu:4", "-o",
                        "/dev/null", "--wrap", "sleep 2"], capture_output=True, env=env,
                       check=True)
        wait_for(lambda: _status(root, "pre") == "requeued", 120, "the requeued summary")
        wait_for(lambda: squeue(slurm_cluster.env, "arith-tiny", "pre")
                 == [(job, "arith-tiny_pre:controller", "PENDING")], 60,
                 "the controller's job alone in the queue")
        out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                             text=True, env=env).stdout
        assert "Restarts=1" in out, out
        with open(os.path.join(trial_root, "logs", "controller.log")) as f:
            log = f.read()
    finally:
        subprocess.run(["scancel", job], env=env)
    assert f"the controller's job {job} was chosen for preemption (" in log, log[-4000:]
    assert "DUE TO JOB REQUEUE" in log and "DUE TO PREEMPTION" not in log, log[-4000:]
    requeued = read_summary(root, "arith-tiny", "pre")["requeued"]
    # the master checkpointed by itself, preempted with the node, at the last step it trained
    assert requeued["job"] == job and requeued["checkpoint_step"] == requeued["last_step"] \
        == max(_steps(trial_root)), requeued
    wait_for(lambda: squeue(slurm_cluster.env, "arith-tiny", "pre") == [], 60, "an empty queue")


def test_a_hung_rollout_task_is_ended_by_its_witness_and_restarted_alone(slurm_cluster,
                                                                        tmp_path):
    """rollout/1 hangs (SIGSTOP) in the job it shares with rollout/0. Its witness vouches for
    it, so it is judged hung only ``hang_grace`` after its heartbeat expired; it restarts alone
    in a job of its own. Slurm cannot stop one task of the old job, which runs on with
    rollout/0: the controller orders the witness to end the hung process, which it does
    (SIGTERM, then SIGKILL). Training goes on meanwhile; the trial, long enough not to end
    before all that on any machine, is then cancelled, and nothing is left."""
    import signal

    from system.ctl.procs import trial_processes
    from tests.helpers import trial_name_resolve

    root = str(tmp_path / "runs")
    trial_root = os.path.join(root, "arith-tiny", "hung")
    env = {**os.environ, **slurm_cluster.env}
    log = os.path.join(trial_root, "logs", "rollout-1.log")
    with _rl_trial(slurm_cluster, root, "hung", "rl.total_steps=100000",
                   *overridden(SLURM, *SMALL, "controller.heartbeat_ttl=4",
                               "controller.hang_grace=6", "scheduler.stop_grace=2"),
                   "recover.retries=1") as (proc, err):
        nr = trial_name_resolve(root, "arith-tiny", "hung")
        vouched = nr.get("arith-tiny/hung/alive/rollout/1")  # host:pid:nonce
        nr.close()
        pid = vouched.split(":")[1]
        os.kill(int(pid), signal.SIGSTOP)
        ordered = f"witness of rollout/1: ordered to end {vouched}"
        wait_for(lambda: proc.poll() is not None or ordered in open(log).read(), 120,
                 "the witness's order")
        wait_for(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the hung process to end")
        wait_for(lambda: proc.poll() is not None or "rejoined: rollout/1" in err.text, 120,
                 "the restarted rollout/1")
        step = max(_steps(trial_root))
        wait_for(lambda: proc.poll() is not None or max(_steps(trial_root)) > step + 3, 120,
                 "more steps")
        assert proc.poll() is None, err.text[-4000:]
        _cancel(env, root, "hung")
        proc.wait(timeout=120)
    assert f"rollout/1: its witness vouches for process {vouched}: ordered to end it" in err.text
    assert "no heartbeat within 4.0s, but its process runs" in err.text
    s = read_summary(root, "arith-tiny", "hung")
    assert s["status"] == "cancelled", s["status"]
    (rec,) = s["recoveries"]
    assert rec["worker"] == "rollout/1" and not rec["stateful"] and rec["steps_lost"] == 0, rec
    assert "nor 6s more while its process ran" in rec["cause"], rec
    assert squeue(slurm_cluster.env, "arith-tiny", "hung") == []
    wait_for(lambda: not trial_processes(trial_root), 10, "the trial's processes to end")
