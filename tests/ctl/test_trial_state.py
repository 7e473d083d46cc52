"""What ctl makes of a trial directory (no trial runs here): the recorded state checked against
the trial's real lock, cancel requests of this run or an earlier one, trials from before
status.json; the controller's status writer and its cancel key, with a real name resolution."""
from __future__ import annotations

import json
import os
import time

import pytest

from scheduler.jobs import JobState, JobStatus
from system import names
from system.ctl.logs import _tail_offset, worker_name
from system.ctl.slurm_query import _parse
from system.ctl.trial_state import read_trial
from system.errors import ConfigError
from system.launcher.config import ExperimentConfig
from system.launcher.status_file import StatusWriter, TrialCancelled
from system.launcher.trial_lock import TrialLock
from system.name_resolve import FileNameResolve
from system.paths import TrialPaths


@pytest.fixture
def paths(tmp_path) -> TrialPaths:
    root = tmp_path / "runs" / "smoke" / "t1"
    (root / "logs").mkdir(parents=True)
    return TrialPaths(str(root))


def _write(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def test_running_only_while_a_process_holds_the_lock(paths):
    _write(paths.status, {"state": "running", "started": time.time() - 5, "scheduler": "local",
                          "progress": {"step": "3/10", "reward": "0.5"}})
    lock = TrialLock.acquire(paths.lock, "smoke/t1")
    view = read_trial(paths)
    assert (view.state, view.live, view.step()) == ("running", True, "3/10")
    assert view.holder is not None and view.holder["pid"] == os.getpid()
    lock.release()
    assert read_trial(paths).state == "lost"  # running, says the record; nobody holds the lock
    _write(paths.cancel_request, {"time": time.time()})
    assert read_trial(paths).state == "cancelled"


def test_final_states_and_cancel_requests(paths):
    t0 = time.time()
    _write(paths.status, {"state": "interrupted", "started": t0})
    assert read_trial(paths).state == "interrupted"
    _write(paths.cancel_request, {"time": t0 - 60})  # asked of an earlier run of the trial
    assert read_trial(paths).state == "interrupted"
    _write(paths.cancel_request, {"time": t0 + 1})
    assert read_trial(paths).state == "cancelled"
    lock = TrialLock.acquire(paths.lock, "smoke/t1")  # launched again, not yet recorded
    assert read_trial(paths).state == "starting"
    lock.release()


def test_a_trial_stopped_during_a_recovery_shows_the_step_it_reached(paths):
    """The master's last progress, written while it restarted, says ``phase starting`` (and
    the checkpoint it resumes from): ``ls`` showed ``phase starting`` for a trial that had
    trained to step 334."""
    t0 = time.time()
    starting = {"phase": "starting", "resumed_from": 334}
    _write(paths.status, {"state": "interrupted", "started": t0, "progress": starting})
    _write(paths.summary, {"status": "interrupted", "t0_epoch": t0, "progress": starting})
    assert read_trial(paths).step() == "334"
    os.remove(paths.status)  # (a summary alone: a trial from before status.json)
    assert read_trial(paths).step() == "334"
    lock = TrialLock.acquire(paths.lock, "smoke/t1")  # live: what it does now
    _write(paths.status, {"state": "running", "started": t0, "progress": starting})
    assert read_trial(paths).step() == "phase starting"
    lock.release()


def test_trial_from_before_status_json(paths):
    _write(paths.summary, {"status": "completed", "scheduler": "slurm", "t0_epoch": 100.0,
                           "jobs": {"master": ["12"], "rollout": ["13"]}})
    view = read_trial(paths)
    assert (view.state, view.scheduler, view.started, view.step()) == ("completed", "slurm",
                                                                         100.0, "-")
    assert [j["id"] for j in view.record["jobs"]] == ["12", "13"]
    os.remove(paths.summary)
    assert read_trial(paths).state == "unknown"


def test_status_writer_records_and_sees_the_cancel_key(paths, tmp_path):
    cfg = ExperimentConfig(exp="smoke", trial="t1")
    nr = FileNameResolve(str(tmp_path / "nr"), secret=b"s" * 32)
    timeline = {"start": time.time()}
    logs = {"master/0": os.path.join(paths.logs, "master-0.log")}
    w = StatusWriter(cfg, paths, timeline["start"], timeline, logs, nr, interval=60)
    assert w.recoveries() == []
    job = JobStatus("123", JobState.RUNNING, ("master/0",), (logs["master/0"],), "up")
    w.tick([job])
    with open(paths.status) as f:
        rec = json.load(f)
    assert rec["state"] == "starting" and rec["jobs"][0]["id"] == "123"
    assert rec["controller"]["pid"] == os.getpid() and rec["logs"] == logs
    timeline["started"] = time.time()
    w.note_progress({"step": "1/5"})
    w.tick([job])  # within the interval: not written again
    with open(paths.status) as f:
        assert json.load(f)["state"] == "starting"
    nr.add(names.cancel("smoke", "t1"), "ctl")
    time.sleep(1.05)  # the key is looked at once a second
    with pytest.raises(TrialCancelled):
        w.tick([job])
    with open(paths.status) as f:
        assert json.load(f)["state"] == "stopping"  # ctl knows the request was seen
    assert read_trial(paths).state == "lost"  # (no process holds this trial's lock)
    ended = JobStatus("123", JobState.CANCELLED, ("master/0",), (logs["master/0"],))
    w.final({"status": "cancelled"}, lambda: [ended])
    with open(paths.status) as f:
        rec = json.load(f)
    assert (rec["state"], rec["phase"], rec["progress"]) == ("cancelled", "started",
                                                              {"step": "1/5"})
    assert rec["jobs"][0]["state"] == "CANCELLED"


def test_squeue_lines_and_worker_names(tmp_path):
    jobs = _parse("7|PENDING|Resources|(null)|smoke_t1:model\n8|RUNNING|None|n1|smoke_t1:master\n")
    assert (jobs["7"].reason, jobs["7"].active, jobs["8"].reason, jobs["8"].node) == (
        "Resources", True, "", "n1")
    assert worker_name("rollout:3") == worker_name("rollout/3") == "rollout/3"
    for bad in ("rollout", "rollout:x", ":1"):
        with pytest.raises(ConfigError):
            worker_name(bad)
    log = tmp_path / "w.log"
    log.write_bytes(b"a\nb\nc\n")
    assert _tail_offset(str(log), 2) == 2 and _tail_offset(str(log), 9) == 0
