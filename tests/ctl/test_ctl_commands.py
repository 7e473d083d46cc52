"""``python -m system.ctl`` on trial directories written here (no trial runs): an evaluation run
of a trial trained with a plugin this process does not have, a running evaluation (under its
trial's lock), the jobs of a lost trial, and output to a reader that has gone (``| head -1``)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from experiments.catalog import get_experiment
from system.bootstrap import Bootstrap
from system.ctl import procs, status
from system.ctl.__main__ import main
from system.ctl.trial_state import read_trial
from system.errors import ConfigError
from system.launch import build_config
from system.launcher.eval_mode import EVAL_DIR
from system.launcher.trial_lock import TrialLock
from system.paths import TrialPaths
from tests.helpers import to_a_closed_pipe


def _write(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def _trial(fileroot: str, exp: str, trial: str) -> TrialPaths:
    paths = TrialPaths(os.path.join(fileroot, exp, trial))
    os.makedirs(paths.logs)
    return paths


def _evaluation(fileroot: str, state: str) -> tuple[TrialPaths, TrialPaths]:
    """arith-tiny/t trained with ``rl.task.reward=absent`` (a plugin no package here declares),
    and its evaluation run (``eval/``) in ``state``."""
    trained = _trial(fileroot, "arith-tiny", "t")
    saved = OmegaConf.structured(get_experiment("arith-tiny").make_config())
    OmegaConf.update(saved, "rl.task.reward", "absent")
    OmegaConf.save(saved, trained.config)
    run = TrialPaths(os.path.join(trained.root, EVAL_DIR))
    os.makedirs(run.logs)
    Bootstrap(exp="arith-tiny", trial="t", experiment="arith-tiny", trial_dir=run.root,
              interface="", scheduler="local", name_resolve={}, name_resolve_root="", rpc={},
              heartbeat_ttl=5.0, mode="eval", evaluated_dir=trained.root).write(run.bootstrap)
    _write(run.status, {"exp": "arith-tiny", "trial": "t", "state": state, "scheduler": "local",
                        "started": time.time() - 5, "jobs": [], "progress": {}, "logs": {}})
    with open(os.path.join(run.logs, "launcher.log"), "w") as f:
        f.write("evaluating step 2\n")
    return trained, run


def test_an_evaluation_needs_none_of_its_trials_plugins(fileroot, capsys):
    """ctl reads where the run is from its own words: the trial's saved config, which names a
    plugin only the trial's environment has (the launcher refuses it here), is not loaded."""
    _, run = _evaluation(fileroot, "completed")
    words = ["exp=arith-tiny", "trial=t", f"cluster.fileroot={fileroot}", "mode=eval"]
    with pytest.raises(ConfigError, match="reward='absent' is neither built in nor a plugin"):
        build_config("arith-tiny", "t", words[2:])
    capsys.readouterr()
    assert main(["status", *words, "--json"]) == 3
    s = json.loads(capsys.readouterr().out)
    assert (s["trial"], s["dir"], s["state"]) == ("arith-tiny/t", run.root, "completed")
    assert main(["logs", *words]) == 0
    assert capsys.readouterr().out == "evaluating step 2\n"
    assert main(["status", *words, "rl.task.reward=first_int"]) == 3  # other words: checked
    assert main(["status", *words, "rl.task.rewrd=x"]) == 2
    assert "unknown key 'rl.task.rewrd'" in capsys.readouterr().err


def test_a_running_evaluation_is_live_under_its_trials_lock(fileroot, capsys):
    """An evaluation holds its trial's lock (not one in ``eval/``) and runs as its trial in name
    resolution: ctl showed a running one as lost, named ``t/eval``."""
    trained, run = _evaluation(fileroot, "running")
    _write(trained.status, {"exp": "arith-tiny", "trial": "t", "state": "completed",
                            "scheduler": "local", "started": time.time() - 60, "jobs": [],
                            "progress": {}, "logs": {}})
    words = ["exp=arith-tiny", "trial=t", f"cluster.fileroot={fileroot}"]
    lock = TrialLock.acquire(trained.lock, "arith-tiny/t", "eval")
    try:
        view = read_trial(run)
        assert (view.exp, view.trial, view.state, view.live) == ("arith-tiny", "t", "running",
                                                                 True)
        training = read_trial(trained)
        assert training.holder is None  # the trial's training is not running
        # but the training's view says what does (ctl said "nothing is left" and exit 0 to a
        # cancel while the evaluation ran on)
        assert training.other_line() == (f"its evaluation (mode=eval) runs: pid {os.getpid()} "
                                         f"on {socket.gethostname()} (see it with mode=eval)")
        assert main(["status", *words]) == 3
        assert "  its evaluation (mode=eval) runs: pid" in capsys.readouterr().out
        assert main(["cancel", *words]) == 1
        assert "cancel that run with the same words and mode=eval" in capsys.readouterr().out
        assert main(["ls", *words[2:]]) == 0
        assert "arith-tiny/t  completed (evaluating)" in capsys.readouterr().out
    finally:
        lock.release()
    assert read_trial(run).state == "lost"
    assert read_trial(trained).other_run is None
    # the trial's training holds the lock: the evaluation is not the one running (was shown
    # live, and cancelling it set the key the training controller watches)
    lock = TrialLock.acquire(trained.lock, "arith-tiny/t", "train")
    try:
        assert read_trial(run).state == "lost" and not read_trial(run).live
        assert read_trial(trained).holder is not None
    finally:
        lock.release()


def _lost(fileroot: str, scheduler: str, host: str, jobs: list[tuple[str, str]]) -> TrialPaths:
    """A smoke trial recorded running whose controller has gone (nobody holds its lock), with
    ``jobs`` (id, recorded state)."""
    paths = _trial(fileroot, "smoke", "lost")
    _write(paths.status, {
        "exp": "smoke", "trial": "lost", "state": "running", "scheduler": scheduler,
        "started": time.time() - 60, "controller": {"pid": 1, "host": host, "slurm_job": ""},
        "jobs": [{"id": i, "workers": [f"rollout/{n}"], "state": s, "detail": "",
                  "restarts": 0, "logs": []} for n, (i, s) in enumerate(jobs)],
        "progress": {}, "logs": {}})
    return paths


def _gone_pid() -> str:
    p = subprocess.Popen(["true"])
    p.wait()
    return str(p.pid)


def test_the_jobs_of_a_lost_trial_are_checked(fileroot, capsys, monkeypatch):
    """A lost trial's recorded jobs are checked as a live trial's: a local pid that is gone is
    EXITED (was RUNNING, its pid long dead), one still running a worker of the trial is
    RUNNING; a recorded end stands. What cannot be checked here is UNKNOWN."""
    gone = _gone_pid()
    root = os.path.join(fileroot, "smoke", "lost")
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "--trial-dir", root])
    deadline = time.time() + 10
    while procs.cmdline(orphan.pid) is None:  # (empty until its exec is done)
        assert time.time() < deadline
        time.sleep(0.01)
    try:
        paths = _lost(fileroot, "local", socket.gethostname(),
                      [(gone, "RUNNING"), (gone, ""), (gone, "FAILED"), ("0", "RUNNING"),
                       (str(orphan.pid), "RUNNING")])
        view = read_trial(paths)
        assert view.state == "lost"
        assert [j["state"] for j in status.jobs(view)] == ["EXITED", "EXITED", "FAILED",
                                                           "EXITED", "RUNNING"]
    finally:
        orphan.kill()
        orphan.wait()
    assert main(["status", "exp=smoke", "trial=lost", f"cluster.fileroot={fileroot}"]) == 6
    assert "RUNNING" not in capsys.readouterr().out

    other = _lost(os.path.join(fileroot, "b"), "local", "elsewhere", [(gone, "RUNNING")])
    assert [j["state"] for j in status.jobs(read_trial(other))] == ["UNKNOWN"]
    slurm = _lost(os.path.join(fileroot, "c"), "slurm", "n1",
                  [("7", "RUNNING"), ("8", "COMPLETED")])
    monkeypatch.setattr(status.slurm_query, "queue", lambda ids, all_states=False: {})
    assert [j["state"] for j in status.jobs(read_trial(slurm))] == ["GONE", "COMPLETED"]
    monkeypatch.setattr(status.slurm_query, "queue", lambda ids, all_states=False: None)
    assert [j["state"] for j in status.jobs(read_trial(slurm))] == ["UNKNOWN", "COMPLETED"]


@pytest.mark.parametrize("buffered", [True, False])
def test_a_reader_that_has_gone_is_no_error(fileroot, buffered):
    """``status ... | head -1`` exits with the trial's state (was 1, 'error: [Errno 32] Broken
    pipe'), without a message; so do ``logs`` (0) and ``--help`` (0)."""
    paths = _lost(fileroot, "local", socket.gethostname(), [(_gone_pid(), "RUNNING")])
    with open(os.path.join(paths.logs, "launcher.log"), "w") as f:
        f.write("a line of the controller's log\n" * 20000)
    words = ["exp=smoke", "trial=lost", f"cluster.fileroot={fileroot}"]
    for args, code in ((["status", *words], 6), (["status", *words, "--json"], 6),
                       (["logs", *words], 0), (["--help"], 0)):
        r = to_a_closed_pipe("system.ctl", buffered, *args)
        assert (r.returncode, r.stderr) == (code, ""), args


def test_ls_given_an_experiments_or_a_trials_directory_lists_its_trials(tmp_path):
    """``ls --fileroot runs/arith-tiny`` (one level down) listed each trial's ``eval/`` run as
    a trial of an experiment named after the trial."""
    from system.ctl.ls import find_trials

    root = tmp_path / "runs"
    for trial in ("t1", "t2"):
        for d in (root / "smoke" / trial, root / "smoke" / trial / "eval"):
            d.mkdir(parents=True)
            (d / "config.yaml").write_text("{}")
    want = [str(root / "smoke" / t) for t in ("t1", "t2")]
    for given in (root, root / "smoke"):
        assert [p.root for p in find_trials(str(given))] == want, given
    assert [p.root for p in find_trials(str(root / "smoke" / "t2"))] == want[1:]
    assert find_trials(str(tmp_path / "absent")) == []


def test_ls_takes_the_file_root_as_the_other_commands_do(tmp_path, capsys):
    """``ls cluster.fileroot=DIR`` (the word the launcher, status, cancel and logs take) lists
    the same trials as ``ls --fileroot DIR``; anything else, or the root given twice, is a usage
    error naming what ls takes."""
    from system.ctl.__main__ import ls_fileroot

    root = str(tmp_path / "runs")
    os.makedirs(os.path.join(root, "smoke", "t1"))
    with open(os.path.join(root, "smoke", "t1", "status.json"), "w") as f:
        json.dump({"state": "completed"}, f)
    assert main(["ls", f"cluster.fileroot={root}"]) == 0
    by_word = capsys.readouterr().out
    assert main(["ls", "--fileroot", root]) == 0
    assert capsys.readouterr().out == by_word and "smoke/t1" in by_word
    assert ls_fileroot(None, []) == "./runs"
    with pytest.raises(ConfigError, match=r"unexpected argument\(s\) \['exp=smoke'\]: ls takes "
                                          r"only --fileroot DIR or cluster.fileroot=DIR"):
        ls_fileroot(None, ["exp=smoke"])
    with pytest.raises(ConfigError, match="give the file root once"):
        ls_fileroot(root, [f"cluster.fileroot={root}"])
    with pytest.raises(ConfigError, match="the file root is empty"):
        ls_fileroot(None, ["cluster.fileroot="])
    assert main(["ls", "exp=smoke"]) == 2
    # a mistyped root is named, not listed as a root without trials
    for bad in (str(tmp_path / "typo"), os.path.join(root, "smoke", "t1", "status.json")):
        with pytest.raises(ConfigError, match="^the file root .* is not a directory"):
            ls_fileroot(bad, [])
    assert main(["ls", "--fileroot", str(tmp_path / "typo")]) == 2
    assert "(it does not exist)" in capsys.readouterr().err


def test_a_trial_never_evaluated_is_named_as_such(fileroot, capsys):
    """``mode=eval`` on a trial that exists but was never evaluated said there was no trial."""
    _trial(fileroot, "arith-tiny", "t")
    words = ["exp=arith-tiny", "trial=t", f"cluster.fileroot={fileroot}", "mode=eval"]
    assert main(["status", *words]) == 2
    err = capsys.readouterr().err
    assert "trial arith-tiny/t has not been evaluated" in err and "mode=eval" in err, err
    assert main(["status", "exp=arith-tiny", "trial=none", *words[2:]]) == 2
    assert "no trial arith-tiny/none under" in capsys.readouterr().err


def test_a_missing_trial_word_says_how_ctl_names_a_trial(fileroot, capsys):
    """ctl's words name a trial; the message showed the launcher's usage instead."""
    assert main(["status", "trial=t", f"cluster.fileroot={fileroot}"]) == 2
    err = capsys.readouterr().err
    assert "missing exp=..." in err and "name the trial as its launch did" in err, err
    assert "system.launch" not in err


def test_logs_takes_one_worker(fileroot, capsys):
    _trial(fileroot, "smoke", "t")
    words = ["exp=smoke", "trial=t", f"cluster.fileroot={fileroot}"]
    assert main(["logs", *words, "master:0", "rollout:1"]) == 2
    assert "logs shows one worker's log at a time (KIND:INDEX), got ['master:0', 'rollout:1']" \
        in capsys.readouterr().err


def test_a_copied_trial_directory_is_shown_under_its_own_name(fileroot, capsys):
    """A copy (``cp -a live live-backup``) holds the bootstrap file of the run it was copied
    from: ``ls`` listed the original twice, and a cancel of the copy named the original."""
    import shutil

    live = _trial(fileroot, "smoke", "live")
    Bootstrap(exp="smoke", trial="live", experiment="smoke", trial_dir=live.root, interface="",
              scheduler="local", name_resolve={}, name_resolve_root="", rpc={},
              heartbeat_ttl=5.0).write(live.bootstrap)
    _write(live.status, {"exp": "smoke", "trial": "live", "state": "completed",
                         "scheduler": "local", "started": time.time() - 60, "jobs": [],
                         "progress": {}, "logs": {}})
    evaluated = TrialPaths(os.path.join(live.root, "eval"))  # (its evaluation, copied with it)
    os.makedirs(evaluated.root)
    Bootstrap(exp="smoke", trial="live", experiment="smoke", trial_dir=evaluated.root,
              interface="", scheduler="local", name_resolve={}, name_resolve_root="", rpc={},
              heartbeat_ttl=5.0, mode="eval", evaluated_dir=live.root).write(evaluated.bootstrap)
    shutil.copytree(live.root, live.root + "-backup")
    backup = read_trial(TrialPaths(live.root + "-backup"))
    assert (backup.exp, backup.trial, backup.state) == ("smoke", "live-backup", "completed")
    assert (read_trial(live).exp, read_trial(live).trial) == ("smoke", "live")
    backup_eval = read_trial(TrialPaths(os.path.join(live.root + "-backup", "eval")))
    assert (backup_eval.exp, backup_eval.trial) == ("smoke", "live-backup")
    assert (read_trial(evaluated).exp, read_trial(evaluated).trial) == ("smoke", "live")
    assert main(["ls", f"cluster.fileroot={fileroot}"]) == 0
    out = capsys.readouterr().out
    assert "smoke/live-backup" in out and out.count("smoke/live ") == 1, out


def test_status_says_the_workers_are_unknown_when_name_resolution_cannot_be_read(fileroot,
                                                                                 capsys):
    """A running trial whose Redis does not answer: every worker was shown missing (0/9, and
    ``alive: []`` in the JSON) above a line saying why nothing could be read."""
    from tests.helpers import free_port, write_secret_file

    run = _trial(fileroot, "smoke", "nr")
    write_secret_file(run.root)
    Bootstrap(exp="smoke", trial="nr", experiment="smoke", trial_dir=run.root, interface="",
              scheduler="local", name_resolve={"type": "redis", "redis_port": free_port()},
              name_resolve_root="", rpc={}, heartbeat_ttl=5.0).write(run.bootstrap)
    _write(run.status, {"exp": "smoke", "trial": "nr", "state": "running", "scheduler": "local",
                        "started": time.time() - 5, "jobs": [], "progress": {}, "logs": {},
                        "workers": {"master": 1, "model": 2}})
    words = ["exp=smoke", "trial=nr", f"cluster.fileroot={fileroot}"]
    lock = TrialLock.acquire(run.lock, "smoke/nr")
    try:
        capsys.readouterr()
        assert main(["status", *words]) == 0
        out = capsys.readouterr().out
        assert "  workers alive (heartbeat): unknown (name resolution not readable: cannot " \
               "reach redis at 127.0.0.1:" in out, out
        assert "missing" not in out
        assert main(["status", *words, "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["workers"] == {"expected": ["master/0", "model/0", "model/1"], "alive": None,
                                "missing": None}
        assert s["controller"]["key_live"] is None
    finally:
        lock.release()
