"""Whole trials on a real single-node Slurm: submission, GPUs, cancellation, requeue, detach."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers import (REPO, launch_argv, overridden, print_stacks, read_summary,
                           run_launch, trial_name_resolve)

pytestmark = pytest.mark.slurm

SLURM = ["scheduler=slurm", "cluster.interface=127.0.0.1", "scheduler.slurm.poll_interval=0.5",
         "scheduler.slurm.model.gpus_per_node=2", "controller.heartbeat_ttl=15",
         "scheduler.stop_grace=3"]
"""(A 15 s heartbeat: these trials' failures are seen through the jobs' states, polled every
0.5 s. A CI run beside an RL trial once saw a model worker's 3 s heartbeat expire while it ran,
in a job of two workers, before their witnesses vouched for such tasks.)"""


def squeue(env: dict, exp: str, trial: str) -> list[tuple[str, str, str]]:
    names = ",".join(f"{exp}_{trial}:{k}" for k in ("controller", "master", "model", "generation",
                                                      "rollout"))
    r = subprocess.run(["squeue", "-h", "-n", names, "-o", "%i|%j|%T"], capture_output=True,
                       text=True, env={**os.environ, **env}, check=True)
    return [tuple(line.split("|")) for line in r.stdout.split()]


def wait_for(cond, timeout: float, what: str, step: float = 0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def job_of(env, exp, trial, kind) -> str:
    return wait_for(lambda: next((j for j, n, _ in squeue(env, exp, trial)
                                  if n.endswith(":" + kind)), None), 30, f"{kind} job")


def heartbeats(fileroot: str, exp: str, trial: str) -> int:
    return len(trial_name_resolve(fileroot, exp, trial).find_subtree(
        f"{exp}/{trial}/heartbeat"))


@contextlib.contextmanager
def running_trial(slurm_cluster, root: str, trial: str, *extra: str, ready: int = 9):
    """A trial launched in the background, yielded once ``ready`` workers (default: all 9) are
    heart-beating; the launcher is killed on the way out if it is still running."""
    words = ["exp=smoke", f"trial={trial}", f"cluster.fileroot={root}"]
    proc = subprocess.Popen(launch_argv(*words, *overridden(SLURM, *extra)),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **slurm_cluster.env})
    try:
        wait_for(lambda: heartbeats(root, "smoke", trial) >= ready, 90, f"{ready} heartbeats")
        yield proc
    finally:
        if proc.poll() is None:
            print_stacks(words, slurm_cluster.env)  # where a trial that did not end is stuck
            proc.kill()


@pytest.fixture
def odd_root(tmp_path) -> str:
    return str(tmp_path / "runs it's \"odd\"")  # spaces and both quotes, all the way down


def test_smoke_on_slurm(slurm_cluster, odd_root):
    r = run_launch("exp=smoke", "trial=s1", f"cluster.fileroot={odd_root}", *SLURM,
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    s = read_summary(odd_root, "smoke", "s1")
    assert s["status"] == "completed" and s["scheduler"] == "slurm"
    assert set(s["jobs"]) == {"master", "model", "generation", "rollout"}
    res = s["results"]
    assert res["trajectories_valid"] == 400 and res["allreduce_ok"] is True
    assert res["model_gpus_on_node"] == [2, 2] and res["model_local_ranks"] == [0, 1]
    trial = os.path.join(odd_root, "smoke", "s1")
    assert sorted(os.listdir(os.path.join(trial, "jobs"))) == [
        "generation.sbatch", "master.sbatch", "model.sbatch", "rollout.sbatch"]
    logs = os.listdir(os.path.join(trial, "logs"))
    for kind, n in s["workers"].items():
        for i in range(n):
            assert f"{kind}-{i}.log" in logs  # one log per task
    assert squeue(slurm_cluster.env, "smoke", "s1") == []


def test_scancel_of_a_worker_job_stops_the_trial(slurm_cluster, tmp_path):
    root = str(tmp_path / "runs")
    with running_trial(slurm_cluster, root, "cancel", "smoke.min_duration=120") as proc:
        job = job_of(slurm_cluster.env, "smoke", "cancel", "generation")
        subprocess.run(["scancel", job], check=True, env={**os.environ, **slurm_cluster.env})
        # the cancel may land while the controller still configures: the stopping worker's
        # configure call times out (30 s) and its job gets requeue_grace (30 s) to show a
        # requeue; the cancelled job is named all the same
        _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    assert "generation/0, generation/1" in err and "CANCELLED" in err and "generation-0.log" in err
    s = read_summary(root, "smoke", "cancel")
    assert s["status"] == "failed" and s["failure"]["worker"] == "generation/0"
    assert squeue(slurm_cluster.env, "smoke", "cancel") == []


def test_ctrl_c_cancels_every_job(slurm_cluster, tmp_path):
    root = str(tmp_path / "runs")
    with running_trial(slurm_cluster, root, "intr", "smoke.min_duration=120") as proc:
        assert len(squeue(slurm_cluster.env, "smoke", "intr")) == 4
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    assert proc.returncode != 0 and "interrupted" in err
    assert squeue(slurm_cluster.env, "smoke", "intr") == []


def test_a_hung_task_of_a_shared_job_is_vouched_for_by_its_witness(slurm_cluster, tmp_path):
    """rollout/1 hangs (SIGSTOP) in the job it shares with rollout/0,2,3: Slurm says only that
    the job runs. Its witness vouches for its process, so its silence is judged as on a busy
    machine: late first, hung ``hang_grace`` later (a 3 s heartbeat, as no Slurm test could
    afford before). Every job and process ends, the stopped one and the witnesses included."""
    from system.ctl.procs import trial_processes

    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=hung", f"cluster.fileroot={root}",
                   *overridden(SLURM, "controller.heartbeat_ttl=3", "controller.hang_grace=3"),
                   "smoke.crash=rollout:1:2.0:stop", "smoke.min_duration=60",
                   env=slurm_cluster.env)
    assert r.returncode != 0
    assert "worker rollout/1: no heartbeat within 3.0s, but its process runs" in r.stderr
    assert ("worker rollout/1 stopped heart-beating (no refresh within 3.0s, nor 3s more "
            "while its process ran; every worker's threads' stacks are at the end of its "
            "log)") in r.stderr
    # every running job got SIGURG (scancel --signal): its tasks wrote their stacks and went
    # on (the stopped one too, if the SIGCONT its witness sends with SIGTERM comes first)
    logs = os.path.join(root, "smoke", "hung", "logs")
    for name in ("master-0", "rollout-0", "model-1"):
        with open(os.path.join(logs, f"{name}.log")) as f:
            assert "every thread's stack, on request:" in f.read(), name
    assert read_summary(root, "smoke", "hung")["failure"]["worker"] == "rollout/1"
    assert squeue(slurm_cluster.env, "smoke", "hung") == []
    wait_for(lambda: not trial_processes(os.path.join(root, "smoke", "hung")), 10,
             "the trial's processes to end")


def test_a_relaunch_cancels_the_jobs_a_killed_controller_left(slurm_cluster, tmp_path):
    """The launcher is killed (-9: no clean-up) with its 4 jobs running, and the trial is
    launched again at once, within the old workers' orphan timeout: the new controller cancels
    those jobs before it submits its own (they would have shared its name-resolution keys),
    says so in one line, and the trial completes."""
    root = str(tmp_path / "runs")
    with running_trial(slurm_cluster, root, "kill9", "smoke.min_duration=120") as proc:
        old = {j for j, _, _ in squeue(slurm_cluster.env, "smoke", "kill9")}
        assert len(old) == 4
        proc.kill()
        proc.wait()
    r = run_launch("exp=smoke", "trial=kill9", f"cluster.fileroot={root}", *SLURM,
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("cancelled job(s) ")]
    listed = line[len("cancelled job(s) "):].split(", left by")[0]
    assert set(listed.split(", ")) == old, line
    assert "left by an earlier run of this trial whose controller died" in line
    assert read_summary(root, "smoke", "kill9")["status"] == "completed"
    assert squeue(slurm_cluster.env, "smoke", "kill9") == []


@pytest.mark.parametrize("watch", ["default", "registration-only"])
def test_preemption_signal_requeues_and_workers_rejoin(slurm_cluster, tmp_path, watch):
    """SIGUSR2 (as Slurm sends before a time limit) -> graceful stop -> the job requeues itself
    -> its workers register again and the controller configures and starts them. With
    ``registration-only`` the controller neither polls squeue nor loses a heartbeat in time, so
    only the workers' new registrations can tell it (a requeued job may run again within a
    second)."""
    root = str(tmp_path / "runs")
    slow = ["scheduler.slurm.poll_interval=60", "controller.heartbeat_ttl=60"] \
        if watch == "registration-only" else []
    proc, err, job = _preempt_rollout_job(slurm_cluster, root, "requeue", slow)
    assert proc.returncode == 0, err
    assert "was requeued" in err and "rejoined: rollout/0" in err
    s = read_summary(root, "smoke", "requeue")
    assert s["status"] == "completed" and s["restarts"] == {job: 1}
    res = s["results"]
    assert res["trajectories_received"] == res["trajectories_valid"] == 400
    # the restarted workers ran their role again (sending everything again); what the master
    # reads of it is recognised as duplicate and never counted twice
    assert res["worker_restarts"] == {f"rollout/{i}": 1 for i in range(4)}
    assert res["trajectories_duplicate"] <= 400
    with open(os.path.join(root, "smoke", "requeue", "logs", "rollout-0.log")) as f:
        log = f.read()
    assert "got SIGUSR2" in log and "requeue of job" in log
    # the batch script, not a worker, requeued the job, after srun had returned
    with open(os.path.join(root, "smoke", "requeue", "logs", f"slurm-rollout-{job}.log")) as f:
        batch = f.read()
    assert batch.index("srun exited") < batch.index("requeue (a worker was preempted)")
    assert squeue(slurm_cluster.env, "smoke", "requeue") == []


def test_preemption_during_start_up_rejoins(slurm_cluster, tmp_path):
    """USR2 to the rollout job while the trial is still starting (its first worker has just
    registered; the controller is registering or configuring): the job requeues, and whether
    the controller meets the new incarnation while configuring or later, the trial completes
    with every trajectory."""
    root = str(tmp_path / "runs")
    # the master's job begins 8 s late, so the controller is still waiting for it to register
    # when the rollout workers stop; it then configures them at their old, dead addresses (3 s
    # timeout) while their requeued job is held back, and must treat that as a requeue; the
    # requeue is seen by polls and registrations, so a loaded machine's starved 3 s heartbeat
    # (a CI run saw the model workers' expire) gets 15 s
    proc, err, job = _preempt_rollout_job(
        slurm_cluster, root, "early",
        ['scheduler.slurm.master.extra_sbatch=["--begin=now+8"]', "rpc.request_timeout=3",
         "scheduler.slurm.requeue_release=0", "controller.heartbeat_ttl=15"],
        when="startup", hold=16.0)
    assert proc.returncode == 0, err
    s = read_summary(root, "smoke", "early")
    assert s["status"] == "completed" and s["restarts"] == {job: 1}
    res = s["results"]
    assert res["trajectories_received"] == res["trajectories_valid"] == 400
    # every rollout worker ran again in its new incarnation: met by the controller while it was
    # configuring (then no "rejoined:" line is printed for it) or rejoined later
    assert res["worker_restarts"] == {f"rollout/{i}": 1 for i in range(4)}, err
    with open(os.path.join(root, "smoke", "early", "logs", f"slurm-rollout-{job}.log")) as f:
        assert "requeue (a worker was preempted)" in f.read()
    assert squeue(slurm_cluster.env, "smoke", "early") == []


def test_detach_submits_the_controller(slurm_cluster, tmp_path):
    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=det", f"cluster.fileroot={root}", *SLURM, "--detach",
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    job = re.search(r"as job (\d+)", r.stdout).group(1)
    assert "tail -f" in r.stdout and f"scancel {job}" in r.stdout
    summary = os.path.join(root, "smoke", "det", "summary.json")
    wait_for(lambda: os.path.exists(summary), 120, "the detached trial's summary")
    assert read_summary(root, "smoke", "det")["status"] == "completed"
    wait_for(lambda: squeue(slurm_cluster.env, "smoke", "det") == [], 60, "the queue to empty")


def test_dry_run_and_test_only(slurm_cluster, tmp_path):
    root = str(tmp_path / "runs")
    r = run_launch("exp=smoke", "trial=dry", f"cluster.fileroot={root}", *SLURM, "--dry-run",
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("#SBATCH --job-name=") == 4 and "nothing submitted" in r.stderr
    assert len(os.listdir(os.path.join(root, "smoke", "dry", "jobs"))) == 4
    assert squeue(slurm_cluster.env, "smoke", "dry") == []
    r = run_launch("exp=smoke", "trial=dry", f"cluster.fileroot={root}", *SLURM, "--test-only",
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("sbatch --test-only: ok") == 4 and "# pre-flight: ok" in r.stdout
    r = run_launch("exp=smoke", "trial=dry", f"cluster.fileroot={root}", *SLURM, "--test-only",
                   "scheduler.slurm.rollout.partition=nosuch", env=slurm_cluster.env)
    assert r.returncode == 1 and "REJECTED" in r.stdout
    assert squeue(slurm_cluster.env, "smoke", "dry") == []


def _preempt_rollout_job(slurm_cluster, root: str, trial: str, extra: list[str],
                         when: str = "running", hold: float = 2.0):
    """Run the smoke trial, USR2 its rollout job (``running``: mid-run; ``startup``: as soon as
    its first worker registered), make the requeued job eligible ``hold`` seconds after the
    requeue, and wait for the launcher: ``(process, stderr, job id)``."""
    env = {**os.environ, **slurm_cluster.env}
    with running_trial(slurm_cluster, root, trial, "smoke.min_duration=25", *extra,
                       ready=9 if when == "running" else 0) as proc:
        nr = trial_name_resolve(root, "smoke", trial)
        if when == "running":  # the master publishes its stream once every worker was started
            nr.wait(f"smoke/{trial}/stream/trajectories", timeout=90)
            time.sleep(3.0)  # and let the job's srun step settle
        else:
            nr.wait(f"smoke/{trial}/worker/rollout/0", timeout=90)
        job = job_of(slurm_cluster.env, "smoke", trial, "rollout")
        subprocess.run(["scancel", "--signal=USR2", job], check=True, env=env)

        def requeued():
            r = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                               text=True, env=env)
            return "Restarts=1" in r.stdout and "JobState=PENDING" in r.stdout
        wait_for(requeued, 60, "the job to requeue itself")
        # Slurm holds a requeued job back (BeginTime) for a while; make it eligible, but not
        # within the second of the kill: slurmd refuses a job whose credential was revoked in
        # the same second ("Job credential revoked"), and the job then ends FAILED
        time.sleep(hold)
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True,
                       env=env)
        _, err = proc.communicate(timeout=180)
    return proc, err, job
