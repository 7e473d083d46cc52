"""``python -m system.ctl`` against a detached smoke trial on a real single-node Slurm: status
shows the controller's job and every worker job (a pending one with Slurm's reason), cancel
leaves none of them in the queue."""
from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from tests.ctl.test_ctl_local import ctl
from tests.helpers import run_launch

pytestmark = pytest.mark.slurm  # about 30 s here

SLURM = ["scheduler=slurm", "cluster.interface=127.0.0.1", "scheduler.slurm.poll_interval=0.5",
         "scheduler.slurm.model.gpus_per_node=2", "controller.heartbeat_ttl=3",
         "scheduler.stop_grace=3"]


def ctl_env(env: dict, *args: str) -> subprocess.CompletedProcess:
    old = dict(os.environ)
    os.environ.update(env)  # ctl's squeue and scancel reach the test cluster
    try:
        return ctl(*args)
    finally:
        os.environ.clear()
        os.environ.update(old)


def queued(env: dict, exp: str, trial: str) -> list[str]:
    r = subprocess.run(["squeue", "-h", "-o", "%i|%j"], capture_output=True, text=True,
                       env={**os.environ, **env}, check=True)
    return [line for line in r.stdout.split() if line.split("|")[1].startswith(f"{exp}_{trial}:")]


def same_name_elsewhere(env: dict, fileroot: str, name: str) -> str:
    """A held job named as one of a trial's, writing under another file root (another trial of
    the same name): ``cancel`` must leave it queued. Its id."""
    logs = os.path.join(fileroot, "smoke", "op", "logs")
    os.makedirs(logs)
    r = subprocess.run(["sbatch", "--parsable", "-J", name, "--begin=now+3600",
                        f"--output={logs}/slurm-model-%j.log", "--wrap", "sleep 600"],
                       capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return r.stdout.strip().split(";")[0]


def test_second_detach_while_the_controller_is_queued(slurm_cluster, tmp_path):
    words = ["exp=smoke", "trial=dd", f"cluster.fileroot={tmp_path / 'runs'}"]
    held = "scheduler.slurm.controller.extra_sbatch=[--begin=now+3600]"  # pending for an hour
    r = run_launch(*words, *SLURM, held, "--detach", env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    controller = re.search(r"as job (\d+)", r.stdout).group(1)
    r = run_launch(*words, *SLURM, "smoke.min_duration=5", "--detach", env=slurm_cluster.env)
    assert r.returncode == 1 and not r.stdout, r.stdout + r.stderr
    assert f"(job {controller}, PENDING)" in r.stderr and f"scancel {controller}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert queued(slurm_cluster.env, "smoke", "dd") == [f"{controller}|smoke_dd:controller"]
    st = ctl_env(slurm_cluster.env, "status", *words, "--json")  # its record is still there
    assert json.loads(st.stdout)["controller"]["slurm_job"] == controller
    r = ctl_env(slurm_cluster.env, "cancel", *words)
    assert r.returncode == 0 and queued(slurm_cluster.env, "smoke", "dd") == [], r.stdout


def test_detached_trial_status_and_cancel(slurm_cluster, tmp_path):
    root = str(tmp_path / "runs")
    words = ["exp=smoke", "trial=op", f"cluster.fileroot={root}"]
    # the generation servers' job may not start for an hour: it stays pending (BeginTime)
    r = run_launch(*words, *SLURM, "smoke.min_duration=120", "--detach",
                   "scheduler.slurm.generation.extra_sbatch=[--begin=now+3600]",
                   env=slurm_cluster.env)
    assert r.returncode == 0, r.stderr
    controller = re.search(r"as job (\d+)", r.stdout).group(1)
    assert "python -m system.ctl cancel exp=smoke trial=op" in r.stdout
    deadline = time.time() + 120  # (the controller's job writes the trial's secret anew)
    while True:  # master, 2 model and 4 rollout workers heart-beat; 5 jobs known
        st = ctl_env(slurm_cluster.env, "status", *words, "--json")
        s = json.loads(st.stdout)
        jobs = {j["workers"][0].split("/")[0]: j for j in s["jobs"]}
        if len(jobs) == 5 and len(s["workers"]["alive"] or []) == 7:
            break
        assert time.time() < deadline, s
        time.sleep(0.5)
    assert st.returncode == 0 and s["state"] == "starting" and s["scheduler"] == "slurm"
    assert s["controller"]["slurm_job"] == controller and s["controller"]["detached"]
    assert jobs["controller"]["id"] == controller and jobs["controller"]["state"] == "RUNNING"
    for kind in ("master", "model", "rollout"):
        assert jobs[kind]["state"] == "RUNNING" and jobs[kind]["node"], jobs[kind]
    assert jobs["generation"]["state"] == "PENDING"
    assert jobs["generation"]["reason"] == "BeginTime"
    assert sorted(s["workers"]["missing"]) == ["generation/0", "generation/1"]
    text = ctl_env(slurm_cluster.env, "status", *words).stdout
    print(text)  # shown with pytest -s: what an operator sees
    assert "reason=BeginTime" in text and "controller.log" in text
    assert len(queued(slurm_cluster.env, "smoke", "op")) == 5
    r = ctl_env(slurm_cluster.env, "stacks", *words)  # the running jobs' tasks: URG, go on
    assert r.returncode == 0, r.stdout + r.stderr
    for kind in ("master", "model", "rollout"):
        assert f"job {jobs[kind]['id']}" in r.stdout.splitlines()[0], r.stdout
    assert f"the controller's job {controller}" in r.stdout.splitlines()[0], r.stdout
    logs = os.path.join(root, "smoke", "op", "logs")
    for name in ("master-0", "model-1", "rollout-3"):
        assert f"==> {os.path.join(logs, name)}.log\n" in r.stdout, r.stdout
    assert r.stdout.count("every thread's stack, on request:") == 8, r.stdout
    assert f"==> {os.path.join(logs, 'controller.log')}\n" in r.stdout, r.stdout
    st = ctl_env(slurm_cluster.env, "status", *words, "--json")
    assert len(json.loads(st.stdout)["workers"]["alive"] or []) == 7
    r = ctl_env(slurm_cluster.env, "ls", "--fileroot", root)
    assert r.returncode == 0 and "smoke/op" in r.stdout.split(), r.stdout
    assert r.stdout.split()[-1] == "slurm" and "starting" in r.stdout.split()

    decoy = same_name_elsewhere(slurm_cluster.env, str(tmp_path / "other"), "smoke_op:model")
    t0 = time.time()
    r = ctl_env(slurm_cluster.env, "cancel", *words)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    assert time.time() - t0 < 30 and "squeue lists none of its jobs" in r.stdout
    assert queued(slurm_cluster.env, "smoke", "op") == [f"{decoy}|smoke_op:model"]
    subprocess.run(["scancel", decoy], env={**os.environ, **slurm_cluster.env}, check=True)
    st = ctl_env(slurm_cluster.env, "status", *words, "--json")
    assert st.returncode == 5 and json.loads(st.stdout)["state"] == "cancelled"
    assert "cancelled" in ctl_env(slurm_cluster.env, "ls", "--fileroot", root).stdout.split()
    r = ctl_env(slurm_cluster.env, "logs", *words)
    assert r.returncode == 0 and "cancelled: stopping every worker" in r.stdout


def test_cancel_does_not_say_nothing_is_left_when_squeue_does_not_answer(slurm_cluster,
                                                                        tmp_path, monkeypatch,
                                                                        capsys):
    """A lost Slurm trial (its launcher killed) whose slurmctld does not answer: cancel said
    "nothing of it is left (squeue lists none of its jobs)", exit 0, and recorded it
    cancelled, while its job stayed queued. It says it cannot tell, exit 1, records nothing;
    once Slurm answers, a cancel removes the job."""
    import signal

    from system.ctl import cancel
    from system.paths import TrialPaths

    for k, v in slurm_cluster.env.items():
        monkeypatch.setenv(k, v)
    paths = TrialPaths(str(tmp_path / "runs" / "smoke" / "lost"))
    os.makedirs(paths.logs)
    r = subprocess.run(["sbatch", "--parsable", "-J", "smoke_lost:master", "--begin=now+3600",
                        f"--output={paths.logs}/slurm-master-%j.log", "--wrap", "sleep 600"],
                       capture_output=True, text=True, check=True)
    job = r.stdout.strip().split(";")[0]
    with open(paths.status, "w") as f:
        json.dump({"exp": "smoke", "trial": "lost", "state": "running", "scheduler": "slurm",
                   "started": time.time() - 60, "jobs": [{"id": job, "kind": "master"}],
                   "progress": {}, "logs": {}}, f)
    monkeypatch.setattr(cancel, "DEADLINE", 5.0)
    with open(os.path.join(slurm_cluster.root, "slurmctld.pid")) as f:
        pid = int(f.read())
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            code = cancel.run(paths)
        finally:
            os.kill(pid, signal.SIGCONT)
        out = capsys.readouterr().out
        assert code == 1, out
        assert "whether jobs of the trial are left is unknown" in out
        assert "nothing of smoke/lost is left" not in out
        assert json.load(open(paths.status))["state"] == "running"  # nothing recorded
        assert not os.path.exists(paths.summary)
        monkeypatch.setattr(cancel, "DEADLINE", 60.0)
        assert cancel.run(paths) == 0
        assert "nothing of smoke/lost is left (squeue lists none of its jobs)" in \
            capsys.readouterr().out
        assert queued(slurm_cluster.env, "smoke", "lost") == []
    finally:
        subprocess.run(["scancel", job])
