"""Warm spares of the local scheduler (real processes): a spare is started once asked, a
restart is forked from it (a child with the worker's index, environment and log file, watched
through the spare's answers), the spare stays for the next restart, and stopping the trial
stops the spares and their workers."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from scheduler.base import GroupSpec, JobState
from scheduler.local import LocalScheduler
from scheduler.spares import SERVES_START_ENV, Activation, Forked
from system.errors import ConfigError

# a worker that, with --standby, forks a child per activation through the real standby code;
# the child (or the process itself, without --standby) prints its index, an environment
# variable, its pid and its parent's pid, then waits
WORKER = (sys.executable, "-c", """
import os, sys
if "--standby" in sys.argv and os.environ.get("SPARE_DIES"):
    sys.exit(3)
if "--standby" in sys.argv and os.environ.get("SPARE_STALLS"):  # never ready ("importing")
    import time; time.sleep(300)
from system.launcher.standby import fork_workers, set_process_name
if "--standby" in sys.argv:
    set_process_name("spare/rollout")
    print("spare waiting", file=sys.stderr, flush=True)
    forked = fork_workers("rollout")
    if forked is None:
        sys.exit(0)
    index = forked[0].index
    if os.environ.get("FORKED_FAILS") in ("all", str(index)):  # a fault only a fork shows
        sys.exit(4)
else:
    index = int(sys.argv[sys.argv.index("--index") + 1])
print(f"worker {index} {os.environ.get('RLSYS_WORKER_INDEX')} {os.environ['MARK']} {os.getpid()}"
      f" {os.getppid()}", flush=True)
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
    try:  # (reaped between two reads: gone)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_restarts_are_forked_from_the_warm_spare_which_stays(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    forked = []
    try:
        (first,) = sched.submit(_group(tmp_path, 0, 0))
        _read(str(tmp_path / "rollout-0.attempt0.log"), "worker 0 0 a0")
        assert not (tmp_path / "spare-rollout.log").exists()  # none before warm_spares()
        sched.warm_spares()
        _read(str(tmp_path / "spare-rollout.log"), "spare waiting")
        (spare,) = sched._spares.processes()
        sched.stop_worker("rollout/0", grace=2)

        for attempt in (1, 2):
            (taken,) = sched.submit(_group(tmp_path, 0, attempt))
            forked.append(int(taken))
            text = _read(str(tmp_path / f"rollout-0.attempt{attempt}.log"),
                         f"worker 0 0 a{attempt}")
            assert f"a{attempt} {taken} {spare.pid}" in text  # a child of the spare
            assert os.getpgid(int(taken)) == int(taken)  # leads its own group
            assert sched._spares.processes() == [spare]  # the same spare, not used up
            assert [s.state for s in sched.poll()] == [JobState.RUNNING]
            os.kill(int(taken), signal.SIGKILL)  # its death is seen through the spare
            _until(lambda: sched.poll()[0].state != JobState.RUNNING)
            (status,) = sched.poll()
            assert status.state == JobState.FAILED and "SIGKILL" in status.detail
            sched.stop_worker("rollout/0", grace=2)
        assert forked[0] != forked[1]
        (taken,) = sched.submit(_group(tmp_path, 0, 3))
        forked.append(int(taken))
    finally:
        sched.stop_all(grace=2)
    assert not _alive(int(first)) and not _alive(spare.pid)
    assert not any(_alive(p) for p in forked)


def test_a_forked_worker_dies_with_its_spare(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    try:
        sched.submit(_group(tmp_path, 0, 0))
        sched.warm_spares()
        _read(str(tmp_path / "spare-rollout.log"), "spare waiting")
        (spare,) = sched._spares.processes()
        sched.stop_worker("rollout/0", grace=2)
        (taken,) = sched.submit(_group(tmp_path, 0, 1))
        _read(str(tmp_path / "rollout-0.attempt1.log"), "worker 0 0 a1")
        spare.kill()
        spare.wait(10)
        _until(lambda: sched.poll()[0].state != JobState.RUNNING)
        assert not _alive(int(taken))
        sched.stop_worker("rollout/0", grace=2)
        (again,) = sched.submit(_group(tmp_path, 0, 2))  # a new process: the spare is dead
        assert int(again) not in (int(taken), spare.pid)
        _read(str(tmp_path / "rollout-0.attempt2.log"), "worker 0 0 a2")
        assert len(sched._spares.processes()) == 1  # and a new spare is warming up
        assert sched._spares.processes()[0].pid != spare.pid
    finally:
        sched.stop_all(grace=2)


def test_spares_asked_for_before_the_start_fork_the_first_workers(tmp_path, monkeypatch):
    """The controller asks for spares before it submits: every group's spare starts first, the
    group's workers are forked from it once it is ready, and it stays for the restarts."""
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    logs = tuple(str(tmp_path / f"rollout-{i}.log") for i in range(2))
    try:
        sched.warm_spares(start_wait=60)
        ids = sched.submit_all([GroupSpec("rollout", 2, WORKER, {"MARK": "a0"}, logs, 0)])
        (spare,) = sched._spares.processes()
        with open(f"/proc/{spare.pid}/environ", "rb") as f:
            assert f"{SERVES_START_ENV}=1".encode() in f.read().split(b"\0")
        for i, pid in enumerate(ids["rollout"]):
            assert f"a0 {pid} {spare.pid}" in _read(logs[i], f"worker {i} {i} a0")
        assert [s.state for s in sched.poll()] == [JobState.RUNNING] * 2
        sched.stop_worker("rollout/1", grace=2)  # a restart: the same spare, at once
        (again,) = sched.submit(GroupSpec("rollout", 1, WORKER, {"MARK": "a1"},
                                          (str(tmp_path / "rollout-1.attempt1.log"),), 1))
        assert f"a1 {again} {spare.pid}" in _read(str(tmp_path / "rollout-1.attempt1.log"),
                                                  "worker 1 1 a1")
        assert sched._spares.processes() == [spare]
    finally:
        sched.stop_all(grace=2)
    assert not _alive(spare.pid) and not any(_alive(int(p)) for p in [*ids["rollout"], again])


@pytest.mark.parametrize("trouble", ["SPARE_DIES", "SPARE_STALLS"])
def test_a_group_whose_spare_dies_or_is_not_ready_in_time_starts_a_process(
        tmp_path, monkeypatch, trouble):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    log = str(tmp_path / "rollout-0.log")
    waits = []
    try:
        sched.warm_spares(start_wait=2 if trouble == "SPARE_STALLS" else 60)
        t0 = time.monotonic()
        (pid,) = sched.submit_all([GroupSpec("rollout", 1, WORKER, {"MARK": "a0", trouble: "1"},
                                             (log,), 0)], lambda: waits.append(1))["rollout"]
        waited = time.monotonic() - t0
        assert f"a0 {pid} {os.getpid()}" in _read(log, "worker 0 0 a0")  # a process of ours
        assert waited >= 2 if trouble == "SPARE_STALLS" else waited < 30, waited
        assert waits  # (the caller's look at a stop request, while it waited)
    finally:
        sched.stop_all(grace=2)


def test_a_group_whose_forked_worker_fails_during_the_start_starts_processes(
        tmp_path, monkeypatch, capsys):
    """A worker forked from its spare fails by itself while the trial starts (a fault that
    only a forked copy shows would fail every attempt): the start's next attempt starts that
    group as processes of its own, its spare is stopped, and none comes back for that kind."""
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    log0, log1 = str(tmp_path / "rollout-0.log"), str(tmp_path / "rollout-0.attempt1.log")
    try:
        sched.warm_spares(start_wait=60)
        sched.submit_all([GroupSpec("rollout", 1, WORKER, {"MARK": "a0", "FORKED_FAILS": "all"},
                                    (log0,), 0)])
        (spare,) = sched._spares.processes()
        _until(lambda: sched.poll()[0].state == JobState.FAILED, timeout=30)
        sched.stop_group("rollout", grace=2)
        assert ("rollout/0, forked from its group's warm spare, failed while the trial started "
                "(exit code 4): rollout workers start as new processes from now on"
                in capsys.readouterr().err)
        assert not _alive(spare.pid) and sched._spares.processes() == []
        (again,) = sched.submit(GroupSpec("rollout", 1, WORKER, {"MARK": "a1",
                                                                  "FORKED_FAILS": "all"},
                                          (log1,), 0))
        assert f"a1 {again} {os.getpid()}" in _read(log1, "worker 0 0 a1")  # a process of ours
        sched.warm_spares()  # (the trial started) no spare for this kind any more
        assert sched._spares.processes() == []
    finally:
        sched.stop_all(grace=2)


def test_a_forked_worker_failing_once_the_trial_runs_keeps_its_spare(tmp_path, monkeypatch,
                                                                      capsys):
    """During the start, a group one of whose workers was killed from outside keeps its spare
    (the others' errors may follow from that kill). Once the trial has started, a restart's
    failure is a failure of that worker: the spare stays and forks the next restart."""
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    logs = tuple(str(tmp_path / f"rollout-{i}.log") for i in range(2))
    try:
        sched.warm_spares(start_wait=60)
        sched.submit_all([GroupSpec("rollout", 2, WORKER, {"MARK": "a0", "FORKED_FAILS": "1"},
                                    logs, 0)])
        (spare,) = sched._spares.processes()
        (line,) = [ln for ln in _read(logs[0], "worker 0 0 a0").splitlines()
                   if ln.startswith("worker 0 0 a0")]
        os.kill(int(line.split()[4]), signal.SIGKILL)
        _until(lambda: [s.state for s in sched.poll()] == [JobState.FAILED] * 2, timeout=30)
        sched.stop_group("rollout", grace=2)
        assert sched._spares.processes() == [spare]
        (pid,) = sched.submit(_group(tmp_path, 0, 1))  # (the start's next attempt)
        assert f"a1 {pid} {spare.pid}" in _read(str(tmp_path / "rollout-0.attempt1.log"),
                                                "worker 0 0 a1")
        sched.warm_spares()  # the trial started
        sched.stop_group("rollout", grace=2)
        sched.submit(GroupSpec("rollout", 1, WORKER, {"MARK": "a2", "FORKED_FAILS": "all"},
                               (str(tmp_path / "rollout-0.attempt2.log"),), 0))
        _until(lambda: sched.poll()[0].state == JobState.FAILED, timeout=30)
        sched.stop_group("rollout", grace=2)
        (again,) = sched.submit(_group(tmp_path, 0, 3))
        assert f"a3 {again} {spare.pid}" in _read(str(tmp_path / "rollout-0.attempt3.log"),
                                                  "worker 0 0 a3")
        assert "failed while the trial started" not in capsys.readouterr().err
    finally:
        sched.stop_all(grace=2)


def _retire(sched, tmp_path):
    """Stop the group's spare so that it cannot answer a restart in time: it is retired (not
    killed) and the restart is left to a new process. Returns the spare's process."""
    sched.submit(_group(tmp_path, 0, 0))
    sched.warm_spares()
    _read(str(tmp_path / "spare-rollout.log"), "spare waiting")
    (spare,) = sched._spares.processes()
    os.kill(spare.pid, signal.SIGSTOP)
    act = Activation(0, {"MARK": "slow", "RLSYS_WORKER_INDEX": "0"},
                     str(tmp_path / "rollout-0.slow.log"))
    assert sched._spares.take(_group(tmp_path, 0, 1), act, timeout=0.5) is None
    assert spare in sched._spares.processes()  # retired, not killed
    os.kill(spare.pid, signal.SIGCONT)
    return spare


def test_a_spare_skips_an_activation_read_past_its_deadline(tmp_path, monkeypatch):
    """The retired spare reads the activation late and skips it (no second copy of the
    worker); having forked no worker, it is stopped at the next poll."""
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    try:
        spare = _retire(sched, tmp_path)
        _read(str(tmp_path / "spare-rollout.log"), "read past its deadline: skipped")
        assert not (tmp_path / "rollout-0.slow.log").exists()

        def polled_and_gone() -> bool:
            sched.poll()
            return not _alive(spare.pid)
        _until(polled_and_gone)
        assert spare not in sched._spares.processes()  # (a new spare took its place)
    finally:
        sched.stop_all(grace=2)


def test_a_late_fork_of_a_retired_spare_is_killed(tmp_path, monkeypatch, capsys):
    """A retired spare that forks a worker all the same (it read the activation just before
    its deadline; here, one without a deadline) has that copy killed at the next poll, and is
    itself stopped once no worker of its own is left."""
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    try:
        spare = _retire(sched, tmp_path)
        late = Activation(0, {"MARK": "late", "RLSYS_WORKER_INDEX": "0"},
                          str(tmp_path / "rollout-0.late.log"))
        spare.stdin.write(late.line())
        spare.stdin.flush()
        text = _read(str(tmp_path / "rollout-0.late.log"), "worker 0 0 late")
        pid = int(text.split()[-2])
        # the copy wrote its log before the spare's report of the fork was read: polled first,
        # the retired spare looked workerless and was stopped, its copy dying with it
        # (PR_SET_PDEATHSIG), unnamed (one loaded CI run)
        (retired,) = [s for s in sched._spares._retired if s.proc is spare]

        def reported() -> bool:
            retired.pump()
            return pid in retired.live
        _until(reported)

        def polled_and_gone(p: int) -> bool:
            sched.poll()
            return not _alive(p)
        _until(lambda: polled_and_gone(pid))
        assert f"forked a worker late (pid {pid}): killed" in capsys.readouterr().err
        _until(lambda: polled_and_gone(spare.pid))  # none of its workers is left
    finally:
        sched.stop_all(grace=2)


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
    off.warm_spares(start_wait=5)  # nothing to do
    assert off._spares is None


def test_only_the_kinds_named_get_a_spare(tmp_path, monkeypatch):
    """``scheduler.local.spare_kinds``: a group of another kind restarts as a new process."""
    from scheduler.config import LocalConfig
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True, spare_kinds=LocalConfig(
        spare_kinds="model,master").kinds_with_spares())
    try:
        sched.submit(_group(tmp_path, 0, 0))
        sched.warm_spares()
        assert sched._spares.processes() == []
        assert not (tmp_path / "spare-rollout.log").exists()
    finally:
        sched.stop_all(grace=2)
    with pytest.raises(ConfigError, match="spare_kinds='model,trainer': no worker kind "
                                          "'trainer'; valid: empty"):
        LocalConfig(spare_kinds="model,trainer")


# the same, with something prepared ahead of each restart in a child of the spare (the pid of
# the process that prepared it, or a failure when PREP_FAILS is set)
PREPARING = (sys.executable, "-c", """
import logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from system.launcher.standby import fork_workers, set_process_name
def prepare():
    if os.environ.get("PREP_FAILS"):
        raise RuntimeError("no engine today")
    return os.getpid()
set_process_name("spare/rollout")
print("spare waiting", file=sys.stderr, flush=True)
forked = fork_workers("rollout", prepare, prepare_delay=6.0,  # (the environment as run_worker)
                      serving_start=os.environ.pop("RLSYS_SPARE_SERVES_START", "") == "1")
if forked is None:
    sys.exit(0)
act, prepared = forked
print(f"worker {act.index} {os.environ['MARK']} {os.getpid()} prepared {prepared}", flush=True)
import time; time.sleep(300)
""")


def _restart(sched, tmp_path, attempt: int) -> tuple[int, str]:
    sched.stop_worker("rollout/0", grace=2)
    g = GroupSpec("rollout", 1, PREPARING, {"MARK": f"a{attempt}"},
                  (str(tmp_path / f"rollout-0.attempt{attempt}.log"),), 0)
    (pid,) = sched.submit(g)
    return int(pid), _read(str(tmp_path / f"rollout-0.attempt{attempt}.log"), "prepared")


def test_a_restart_takes_over_what_the_spare_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    spare_log = str(tmp_path / "spare-rollout.log")
    try:
        sched.submit(GroupSpec("rollout", 1, PREPARING, {"MARK": "a0"},
                               (str(tmp_path / "rollout-0.log"),), 0))
        sched.warm_spares()
        _read(spare_log, "prepared for a restart")
        pid, text = _restart(sched, tmp_path, 1)
        assert f"a1 {pid} prepared {pid}" in text  # the preparing child became the worker
        pid, text = _restart(sched, tmp_path, 2)  # the next one waits 6 s before preparing
        assert f"a2 {pid} prepared None" in text
        _until(lambda: open(spare_log).read().count("prepared for a restart") == 2, 40)
        pid, text = _restart(sched, tmp_path, 3)
        assert f"a3 {pid} prepared {pid}" in text
        assert [s.state for s in sched.poll()] == [JobState.RUNNING]
    finally:
        sched.stop_all(grace=2)


def test_a_spare_that_forks_the_first_workers_prepares_only_later(tmp_path, monkeypatch):
    """Nothing is prepared while the trial's first workers start (here 6 s, in the trial
    PREPARE_AFTER_RESTART_S): a restart meanwhile is a fresh fork, a later one takes over what
    was prepared."""
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    sched = LocalScheduler(spares=True)
    spare_log = str(tmp_path / "spare-rollout.log")
    try:
        sched.warm_spares(start_wait=60)
        (first,) = sched.submit_all([GroupSpec("rollout", 1, PREPARING, {"MARK": "a0"},
                                               (str(tmp_path / "rollout-0.log"),), 0)])["rollout"]
        assert f"a0 {first} prepared None" in _read(str(tmp_path / "rollout-0.log"), "prepared")
        pid, text = _restart(sched, tmp_path, 1)
        assert f"a1 {pid} prepared None" in text
        assert "prepared for a restart" not in open(spare_log).read()
        _read(spare_log, "prepared for a restart")
        pid, text = _restart(sched, tmp_path, 2)
        assert f"a2 {pid} prepared {pid}" in text
    finally:
        sched.stop_all(grace=2)


def test_a_failed_preparation_leaves_restarts_to_fresh_forks(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    monkeypatch.setenv("PREP_FAILS", "1")
    sched = LocalScheduler(spares=True)
    spare_log = str(tmp_path / "spare-rollout.log")
    try:
        sched.submit(GroupSpec("rollout", 1, PREPARING, {"MARK": "a0"},
                               (str(tmp_path / "rollout-0.log"),), 0))
        sched.warm_spares()
        text = _read(spare_log, "restarts prepare their own")
        assert "no engine today" in text  # the cause, in the spare's log
        pid, text = _restart(sched, tmp_path, 1)
        assert f"a1 {pid} prepared None" in text
    finally:
        sched.stop_all(grace=2)


@pytest.mark.parametrize("line, why", [
    ("not json", "not JSON"),
    ('{"index": 1, "env": {}}', "exactly index, env and log"),
    ('{"index": -1, "env": {}, "log": "/x"}', "index must be an int >= 0"),
    ('{"index": 1, "env": {"A": 1}, "log": "/x"}', "env must map str to str"),
    ('{"index": 1, "env": {}, "log": "rel"}', "absolute path"),
    ('{"index": 1, "env": {}, "log": "/x", "deadline": "soon"}', "deadline must be a number"),
    ('{"index": 1, "env": {}, "log": "/x", "x": 1}', "exactly index, env and log"),
])
def test_a_malformed_activation_is_refused(line, why):
    with pytest.raises(ConfigError, match=why):
        Activation.parse(line)
    assert Activation.parse(Activation(2, {"A": "b"}, "/l").line().decode()) == \
        Activation(2, {"A": "b"}, "/l")
    timed = Activation(2, {}, "/l", time.monotonic() + 60)
    assert Activation.parse(timed.line().decode()) == timed and not timed.expired()
    assert Activation(2, {}, "/l", time.monotonic() - 1).expired()


@pytest.mark.parametrize("line, why", [
    ("[]", "exactly pid and code"),
    ('{"pid": 0, "code": null}', "pid must be > 0"),
    ('{"pid": 5, "code": "x"}', "code must be an int"),
    ('{"pid": true, "code": null}', "pid must be an int"),
])
def test_a_malformed_spare_answer_is_refused(line, why):
    with pytest.raises(ConfigError, match=why):
        Forked.parse(line)
    assert Forked.parse(Forked(7, -9).line().decode()) == Forked(7, -9)
