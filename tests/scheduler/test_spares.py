"""Warm spares of the local scheduler (real processes): a spare is started once asked, a
restart takes it over (same process, the worker's index, environment and log file), a new spare
replaces it, and stopping the trial stops the spares too."""
from __future__ import annotations

import os
import sys
import time

import pytest

from scheduler.base import GroupSpec, JobState
from scheduler.local import LocalScheduler
from scheduler.spares import Activation
from system.errors import ConfigError

# a worker that, with --standby, waits for its activation through the real standby code; then
# (or at once, without --standby) prints its index, an environment variable and its pid
WORKER = (sys.executable, "-c", """
import os, sys
from system.launcher.standby import set_process_name, wait_for_activation
if "--standby" in sys.argv:
    set_process_name("spare/rollout")
    print("spare waiting", flush=True)
    act = wait_for_activation()
    if act is None:
        sys.exit(0)
    index = act.index
else:
    index = int(sys.argv[sys.argv.index("--index") + 1])
print(f"worker {index} {os.environ.get('RLSYS_WORKER_INDEX')} {os.environ['MARK']} {os.getpid()}",
      flush=True)
import time; time.sleep(300)
""")


def _group(tmp_path, first: int, attempt: int) -> GroupSpec:
    return GroupSpec("rollout", 1, WORKER, {"MARK": f"a{attempt}"},
                     (str(tmp_path / f"rollout-{first}.attempt{attempt}.log"),), first)


def _read(path: str, want: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and want in open(path).read():
            return open(path).read()
        time.sleep(0.05)
    raise AssertionError(f"{path} never showed {want!r}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_restart_takes_over_the_warm_spare_and_a_new_one_replaces_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    try:
        (first,) = sched.submit(_group(tmp_path, 0, 0))
        _read(str(tmp_path / "rollout-0.attempt0.log"), "worker 0 0 a0")
        assert not (tmp_path / "spare-rollout.log").exists()  # none before warm_spares()
        sched.warm_spares()
        spare_log = str(tmp_path / "spare-rollout.log")
        _read(spare_log, "spare waiting")
        (spare,) = sched._spares.processes()
        sched.stop_worker("rollout/0", grace=2)

        (taken,) = sched.submit(_group(tmp_path, 0, 1))
        assert int(taken) == spare.pid  # the spare became the worker
        text = _read(str(tmp_path / "rollout-0.attempt1.log"), "worker 0 0 a1")
        assert f"a1 {spare.pid}" in text
        with open(f"/proc/{spare.pid}/comm") as f:
            assert f.read().strip() == "spare/rollout"  # (the real run_worker renames it)
        (fresh,) = sched._spares.processes()  # replaced at once
        assert fresh.pid != spare.pid
        _read(spare_log, "spare waiting\nspare waiting")
        assert [s.state for s in sched.poll()] == [JobState.RUNNING]
    finally:
        sched.stop_all(grace=2)
    assert not _alive(int(first)) and not _alive(spare.pid) and not _alive(fresh.pid)


def test_without_spares_or_a_dead_spare_a_restart_starts_a_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    try:
        sched.submit(_group(tmp_path, 0, 0))
        sched.warm_spares()
        (spare,) = sched._spares.processes()
        spare.kill()
        spare.wait(10)
        sched.stop_worker("rollout/0", grace=2)
        (pid,) = sched.submit(_group(tmp_path, 0, 1))
        assert int(pid) != spare.pid
        _read(str(tmp_path / "rollout-0.attempt1.log"), "worker 0 0 a1")
    finally:
        sched.stop_all(grace=2)
    off = LocalScheduler(spares=False)
    off.warm_spares()  # nothing to do
    assert off._spares is None


@pytest.mark.parametrize("line, why", [
    ("not json", "not JSON"),
    ('{"index": 1, "env": {}}', "exactly index, env and log"),
    ('{"index": -1, "env": {}, "log": "/x"}', "index must be an int >= 0"),
    ('{"index": 1, "env": {"A": 1}, "log": "/x"}', "env must map str to str"),
    ('{"index": 1, "env": {}, "log": "rel"}', "absolute path"),
])
def test_a_malformed_activation_is_refused(line, why):
    with pytest.raises(ConfigError, match=why):
        Activation.parse(line)
    assert Activation.parse(Activation(2, {"A": "b"}, "/l").line().decode()) == \
        Activation(2, {"A": "b"}, "/l")
