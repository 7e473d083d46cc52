"""Two trials of one name (``exp``/``trial``) in two directories on one name service (a shared
Redis or ``name_resolve.file_root``): the second is refused in one line naming the first; the
first runs on untouched (the second cleared its keys and took them over before)."""
from __future__ import annotations

import json
import os
import subprocess

from system.bootstrap import read_secret
from system.launcher.name_claim import controller_record, other_trial
from system.name_resolve import FileNameResolve
from tests.helpers import REPO, launch_argv, read_summary, run_launch, trial_name_resolve

SMALL = ["rollout.count=1", "model.count=1", "generation.count=1",
         "smoke.trajectories_per_worker=5", "controller.heartbeat_ttl=2", "scheduler.stop_grace=3",
         "controller.progress=false"]


def test_a_second_trial_of_the_same_name_on_one_name_service_is_refused(tmp_path):
    names = str(tmp_path / "names")
    first_root, second_root = str(tmp_path / "a"), str(tmp_path / "b")
    common = ("exp=smoke", "trial=same", f"name_resolve.file_root={names}", *SMALL)
    first = subprocess.Popen(launch_argv(*common, f"cluster.fileroot={first_root}",
                                         "smoke.min_duration=15"),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        trial_name_resolve(first_root, "smoke", "same")  # (its files are written)
        nr = FileNameResolve(names, secret=read_secret(
            os.path.join(first_root, "smoke", "same", "secret")))
        nr.wait("smoke/same/controller", 60)
        r = run_launch(*common, f"cluster.fileroot={second_root}")
        assert r.returncode == 1, r.stderr
        first_dir = os.path.join(first_root, "smoke", "same")
        assert (f"error: trial smoke/same is live on this name service from another directory "
                f"({first_dir}, controller pid ") in r.stderr, r.stderr
        assert "use another trial= name" in r.stderr
        assert not os.path.exists(second_root)  # refused before anything was written
        _, err = first.communicate(timeout=120)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert read_summary(first_root, "smoke", "same")["status"] == "completed"
    # once the first has ended, the name is free
    r = run_launch(*common, f"cluster.fileroot={second_root}", "smoke.min_duration=0")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_controller_key_is_another_trials_unless_it_names_this_directory(tmp_path):
    mine = str(tmp_path / "a" / "smoke" / "t")
    assert other_trial(controller_record(mine), mine) is None  # this trial's earlier run
    other = json.loads(controller_record(str(tmp_path / "b")))
    assert other_trial(json.dumps(other), mine) == (
        f"{other['trial_dir']}, controller pid {other['pid']} on {other['host']}")
    assert other_trial("12345", mine) == "an unknown trial directory"  # (an older release)
    assert other_trial(controller_record(os.path.join(mine, "eval")), mine) is None  # mode=eval
    os.makedirs(mine)
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert other_trial(controller_record(mine), str(tmp_path / "link" / "smoke" / "t")) is None
