"""``python -m system.ctl`` against real local smoke trials, run from another process (and
session) than the launcher's: ls, status, logs (-f), cancel, and cancel of a controller that
no longer answers."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from system import names
from tests.helpers import REPO, launch_argv, read_summary, trial_name_resolve, trial_processes

FAST = ["scheduler.stop_grace=3"]  # the default heartbeat TTL: this machine is often loaded


def ctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "system.ctl", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def start_trial(fileroot: str, trial: str) -> subprocess.Popen:
    """A smoke trial that runs for two minutes, launched in a session of its own (as from
    another shell), returned once its 9 workers heart-beat."""
    proc = subprocess.Popen(launch_argv("exp=smoke", f"trial={trial}",
                                        f"cluster.fileroot={fileroot}", "smoke.min_duration=120",
                                        *FAST),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    nr = trial_name_resolve(fileroot, "smoke", trial)
    deadline = time.time() + 60
    while len(nr.find_subtree(f"smoke/{trial}/heartbeat")) < 9:
        assert time.time() < deadline and proc.poll() is None, "the trial did not start"
        time.sleep(0.1)
    return proc


def status(fileroot: str, trial: str) -> tuple[int, dict]:
    r = ctl("status", "exp=smoke", f"trial={trial}", f"cluster.fileroot={fileroot}", "--json")
    return r.returncode, json.loads(r.stdout)


def test_ls_status_logs_cancel(fileroot):
    trial_dir = os.path.join(fileroot, "smoke", "op")
    words = ["exp=smoke", "trial=op", f"cluster.fileroot={fileroot}"]
    proc = start_trial(fileroot, "op")
    try:
        # the controller's record says running within seconds, and the master's progress soon
        # after (a loaded machine showed '0/400' at first)
        # (and every worker's heartbeat alive: one 2 s heartbeat may lapse for a moment)
        deadline = time.time() + 30
        while (s := status(fileroot, "op"))[1]["state"] != "running" or (
                (s[1].get("progress") or {}).get("trajectories") != "400/400") or len(
                s[1]["workers"]["alive"] or []) != 9:
            assert time.time() < deadline, s
            time.sleep(0.5)
        code, s = s
        assert code == 0 and s["scheduler"] == "local" and s["controller"]["pid"] == proc.pid
        assert len(s["jobs"]) == 9 and {j["state"] for j in s["jobs"]} == {"RUNNING"}
        assert sorted(int(j["id"]) for j in s["jobs"]) == sorted(trial_processes(trial_dir))
        assert len(s["workers"]["alive"] or []) == 9 and s["workers"]["missing"] == []
        assert s["progress"]["trajectories"] == "400/400"
        assert all(os.path.isfile(p) for p in s["logs"].values())
        assert s["endpoints"] == {}  # smoke serves no OpenAI endpoint; one that does shows:
        trial_name_resolve(fileroot, "smoke", "op").add(
            names.http_address("smoke", "op", 0), "http://127.0.0.1:8123", replace=True)
        assert status(fileroot, "op")[1]["endpoints"] == {"0": "http://127.0.0.1:8123"}
        assert ("OpenAI endpoints (key: the trial's api_key file): generation/0 "
                "http://127.0.0.1:8123") in ctl("status", *words).stdout

        deadline = time.time() + 20  # ls reads status.json, rewritten every 2 s
        while True:
            r = ctl("ls", "--fileroot", fileroot)
            assert r.returncode == 0
            if "trajectories" in r.stdout.split() or time.time() > deadline:
                break
            time.sleep(0.5)
        assert ["smoke/op", "running", "trajectories", "400/400"] == r.stdout.split()[5:9]
        assert r.stdout.split()[-1] == "local"

        r = ctl("logs", *words, "rollout:1")
        assert r.returncode == 0 and "rollout/1 registered at" in r.stdout
        assert ctl("logs", *words, "rollout:9").returncode == 2
        assert ctl("logs", *words).returncode == 0  # the launcher's own log
        r = ctl("stacks", *words)  # every worker and the launcher write their stacks, go on
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"the controller (pid {proc.pid})" in r.stdout.splitlines()[0], r.stdout
        assert r.stdout.count("every thread's stack, on request:") == 10, r.stdout
        logs = os.path.join(trial_dir, "logs")
        assert f"==> {os.path.join(logs, 'master-0.log')}\n" in r.stdout, r.stdout
        assert ", in master_role\n" in r.stdout and "rollout-3.log" in r.stdout
        assert f"==> {os.path.join(logs, 'launcher.log')}\n" in r.stdout, r.stdout
        assert ", in run_trial\n" in r.stdout, r.stdout  # (the launcher's main thread)
        assert len(trial_processes(trial_dir)) == 9 and status(fileroot, "op")[0] == 0
        follow = subprocess.Popen([sys.executable, "-m", "system.ctl", "logs", *words,
                                   "master:0", "-f"], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

        t0 = time.time()
        r = ctl("cancel", *words)
        assert r.returncode == 0, r.stdout + r.stderr
        assert time.time() - t0 < 30 and "nothing of smoke/op is left" in r.stdout
        assert "SIGTERM" not in r.stdout  # the controller stopped it, asked through the key
        assert trial_processes(trial_dir) == []
        assert proc.wait(10) != 0
        out, err = follow.communicate(timeout=15)  # -f ends with the trial
        assert "master/0" in out and "the trial has ended (cancelled)" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    code, s = status(fileroot, "op")
    assert code == 5 and s["state"] == "cancelled"
    assert {j["state"] for j in s["jobs"]} <= {"CANCELLED", "COMPLETED", "FAILED"}
    summary = read_summary(fileroot, "smoke", "op")
    assert summary["status"] == "cancelled"
    assert summary["progress"] == s["progress"] and summary["progress"]["trajectories"]
    with open(os.path.join(trial_dir, "logs", "launcher.log")) as f:
        assert "cancelled: stopping every worker" in f.read()
    r = ctl("ls", "--fileroot", fileroot)
    assert "cancelled" in r.stdout.split()
    # what ctl wrote is as private as the trial's other files (ctl sets no umask of its own)
    for name in ("cancel.json", "status.json", "summary.json"):
        assert stat.S_IMODE(os.stat(os.path.join(trial_dir, name)).st_mode) == 0o600, name
    # cancelling again finds nothing to do
    r = ctl("cancel", *words)
    assert r.returncode == 0 and "is cancelled" in r.stdout


def test_cancel_stops_a_trial_whose_controller_does_not_answer(fileroot):
    """The launcher is stopped (SIGSTOP): it neither sees the cancel key nor acts on SIGTERM;
    cancel stops its workers and it, checked through /proc, and records the end itself."""
    trial_dir = os.path.join(fileroot, "smoke", "hung")
    words = ["exp=smoke", "trial=hung", f"cluster.fileroot={fileroot}"]
    os.makedirs(trial_dir)
    for name in ("summary.json", "status.json"):  # a previous run's
        with open(os.path.join(trial_dir, name), "w") as f:
            json.dump({"exp": "smoke", "trial": "hung", "status": "completed",
                       "state": "completed", "started": 1.0}, f)
    proc = start_trial(fileroot, "hung")
    # the launch removed the previous run's outcome: it does not describe this run
    assert not os.path.exists(os.path.join(trial_dir, "summary.json"))
    with open(os.path.join(trial_dir, "status.json")) as f:
        assert json.load(f)["started"] > 1.0  # this run's (the controller's first record)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.time()
        r = ctl("cancel", *words, "--grace", "6")
        assert r.returncode == 0, r.stdout + r.stderr
        assert time.time() - t0 < 30
        assert "did not stop in time" in r.stdout
        assert f"SIGTERM to the controller (pid {proc.pid})" in r.stdout
        assert trial_processes(trial_dir) == [] and proc.wait(5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    code, s = status(fileroot, "hung")
    assert code == 5 and s["state"] == "cancelled"
    with open(os.path.join(trial_dir, "status.json")) as f:
        assert json.load(f)["phase"] == "stopped by system.ctl cancel"
    summary = read_summary(fileroot, "smoke", "hung")  # the run's own, written by cancel
    assert summary["status"] == "cancelled" and summary["written_by"] == "system.ctl cancel"
    assert summary["t0_epoch"] > 0 and "without a final record" in summary["failure"]["message"]
    assert "status.json and summary.json now say cancelled" in r.stdout


def test_usage_errors(fileroot):
    assert ctl("status", "exp=smoke", "trial=none", f"cluster.fileroot={fileroot}").returncode == 2
    assert ctl("status", "exp=nosuch", "trial=t").returncode == 2
    assert ctl("status", "trial=t").returncode == 2
    r = ctl("ls", "--fileroot", fileroot)  # a mistyped root is named, not an empty one
    assert r.returncode == 2 and "is not a directory (it does not exist)" in r.stderr
    os.makedirs(fileroot)
    r = ctl("ls", "--fileroot", fileroot)
    assert r.returncode == 0 and "no trials" in r.stdout
    words = ["exp=smoke", "trial=dry", f"cluster.fileroot={fileroot}"]
    assert subprocess.run(launch_argv(*words, "--dry-run"), cwd=REPO, capture_output=True,
                          timeout=120).returncode == 0
    r = ctl("logs", *words)
    assert r.returncode == 2 and "the trial has not run (a --dry-run" in r.stderr
    r = ctl("logs", *words, "-n", "-2")
    assert r.returncode == 2 and "'-2' is not a count of lines" in r.stderr


@pytest.mark.redis
def test_status_and_cancel_with_redis_name_resolution(fileroot, redis_server):
    """ctl finds the trial's Redis through its bootstrap file: heartbeats, the cancel key."""
    _, port = redis_server
    words = ["exp=smoke", "trial=red", f"cluster.fileroot={fileroot}"]
    proc = subprocess.Popen(launch_argv(*words, "name_resolve=redis",
                                        f"name_resolve.redis_port={port}",
                                        "smoke.min_duration=120", *FAST),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(fileroot, "smoke", "red", "bootstrap.json")):
            assert time.time() < deadline and proc.poll() is None, "no trial directory"
            time.sleep(0.1)
        while len((s := status(fileroot, "red")[1])["workers"]["alive"] or []) < 9:
            assert time.time() < deadline and proc.poll() is None, s
            time.sleep(0.5)
        assert s["name_resolution"] == "ok" and s["controller"]["key_live"] is True
        r = ctl("cancel", *words)
        assert r.returncode == 0 and "the controller has stopped; trial cancelled" in r.stdout
        assert proc.wait(10) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert trial_processes(os.path.join(fileroot, "smoke", "red")) == []
    assert status(fileroot, "red")[0] == 5
