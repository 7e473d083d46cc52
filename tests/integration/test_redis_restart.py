"""The name service restarts mid-trial: a real redis-server is killed (SIGKILL, no persistence:
every key is lost) while arith-tiny trains and started again on the same port a few seconds
later. Every process waits the outage out and adds back what it had registered; heartbeats
missed meanwhile are no news; the trial completes with no recovery, no generation server
dropped and no rollout lease released."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from system.paths import PROJECT_ROOT
from tests.helpers import (NO_SPARES, REPO, free_port, launch_argv, metrics_rows,
                           read_summary, start_redis, trial_processes)

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.skipif(
    not os.path.isfile(os.path.join(PROJECT_ROOT, ".models", "arith-tiny", "config.json")),
    reason="the arith-tiny model is created by scripts/setup.sh")]

SMALL = ["rl.batch_size=4", "rl.group_size=4", "rl.task.train_size=14", "rl.task.eval_size=8",
         "rl.eval_interval=0", "controller.progress=false", NO_SPARES]


def _steps(root: str) -> int:
    return max((row["step"] for row in metrics_rows(root)), default=-1)


def test_a_redis_restart_mid_trial_costs_no_recovery(fileroot):
    port = free_port()
    redis = start_redis(port)
    root = os.path.join(fileroot, "arith-tiny", "rr")
    proc = subprocess.Popen(launch_argv("exp=arith-tiny", "trial=rr",
                                        f"cluster.fileroot={fileroot}", "name_resolve=redis",
                                        f"name_resolve.redis_port={port}", "rl.total_steps=40",
                                        *SMALL),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while _steps(root) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "no step 3"
            time.sleep(0.25)
        redis.kill()
        redis.wait(10)
        time.sleep(4.0)  # longer than a third of the heartbeat TTL: every process notices
        redis = start_redis(port)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        redis.kill()
        redis.wait(10)
    assert proc.returncode == 0, err[-3000:]
    s = read_summary(fileroot, "arith-tiny", "rr")
    assert s["status"] == "completed" and s["steps"] == 40
    assert not s.get("recoveries"), s.get("recoveries")
    logs = os.path.join(root, "logs")
    master = open(os.path.join(logs, "master-0.log")).read()
    assert "left routing" not in master and "released its" not in master
    for name in ("master-0", "model-0", "generation-0", "rollout-0", "rollout-1"):
        text = open(os.path.join(logs, f"{name}.log")).read()
        assert "as a new server" in text, name  # it added back what it held
    assert trial_processes(root) == []


def test_a_stop_while_the_name_service_is_down_waits_out_no_outage(fileroot):
    """SIGTERM to a trial whose Redis had gone took the whole outage timeout (30 s) to stop:
    the keep-alive threads held, through a refresh retried for 30 s, the lock the stop's
    clean-up needs. A stop now waits at most a few seconds for the name service."""
    port = free_port()
    redis = start_redis(port)
    root = os.path.join(fileroot, "smoke", "down")
    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=down", f"cluster.fileroot={fileroot}",
                                        "name_resolve=redis", f"name_resolve.redis_port={port}",
                                        "smoke.min_duration=120", "controller.progress=false"),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(root, "status.json")) or json.load(
                open(os.path.join(root, "status.json"))).get("state") != "running":
            assert proc.poll() is None and time.monotonic() < deadline, "never running"
            time.sleep(0.25)
        time.sleep(2.0)  # every worker registered
        redis.kill()
        redis.wait(10)
        time.sleep(2.0)  # keep-alive refreshes meet the outage (and retry)
        t0 = time.monotonic()
        proc.terminate()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        redis.kill()
        redis.wait(10)
    assert proc.returncode == 1, err[-3000:]
    assert took < 15.0, f"{took:.1f}s to stop\n{err[-3000:]}"
    assert read_summary(fileroot, "smoke", "down")["status"] == "interrupted"
    assert trial_processes(root) == []
