"""The trial directory against another user of the same file root: it is private (or
group-readable when asked), a pre-created one of someone else is refused, a swapped or loose
secret is refused, and the trial's lock lets one launcher or controller in at a time."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from system.bootstrap import Bootstrap, read_secret
from system.errors import TrialLocked, UnsafeFileError
from system.launcher.trial_lock import TrialLock
from tests.helpers import REPO, run_launch, write_secret_file

OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


def _modes(root: str) -> dict[str, int]:
    """``{relative path: permission bits}`` of everything under ``root`` (itself as ``.``)."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def _dry_run(fileroot: str, trial: str, *extra: str) -> subprocess.CompletedProcess:
    return run_launch("exp=smoke", f"trial={trial}", f"cluster.fileroot={fileroot}",
                      "scheduler=slurm", "--dry-run", *extra)


@pytest.mark.parametrize("group, dirs, files", [(False, 0o700, 0o600), (True, 0o750, 0o640)])
def test_trial_files_are_private_unless_group_readable(fileroot, group, dirs, files):
    os.makedirs(fileroot)
    os.chmod(fileroot, 0o755)  # an existing parent keeps its mode: never loosened nor changed
    r = _dry_run(fileroot, "modes", f"cluster.group_readable={str(group).lower()}")
    assert r.returncode == 0, r.stderr
    trial_dir = os.path.join(fileroot, "smoke", "modes")
    modes = _modes(trial_dir)
    assert {"config.yaml", "secret", "bootstrap.json", "lock", "logs", "jobs",
            "jobs/master.sbatch"} <= set(modes)
    assert modes.pop("secret") == 0o600 and modes.pop("lock") == 0o600  # private either way
    assert modes.pop("api_key") == 0o600
    for path, mode in modes.items():
        expected = dirs if os.path.isdir(os.path.join(trial_dir, path)) else files
        assert mode == expected, f"{path}: {mode:o}, expected {expected:o}"
    assert stat.S_IMODE(os.stat(fileroot).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(os.path.join(fileroot, "smoke")).st_mode) == dirs  # new parent
    assert Bootstrap.read(os.path.join(trial_dir, "bootstrap.json")).group_readable is group


def test_workers_are_told_how_long_slurms_warning_is(fileroot):
    """A warned worker sizes its checkpoint wait by it when ``scontrol`` does not answer
    (``workers/preempt_wait.py``); the local scheduler sends no such warning."""
    assert _dry_run(fileroot, "warned", "scheduler.slurm.signal_seconds=300").returncode == 0
    boot = Bootstrap.read(os.path.join(fileroot, "smoke", "warned", "bootstrap.json"))
    assert boot.preempt_warning == 300.0
    r = run_launch("exp=smoke", "trial=here", f"cluster.fileroot={fileroot}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert Bootstrap.read(os.path.join(fileroot, "smoke", "here", "bootstrap.json")
                          ).preempt_warning == 0.0


def test_a_dry_run_of_an_existing_trial_leaves_its_files(fileroot):
    """A dry run shows what a launch would run; the trial's config (read by mode=eval and the
    next launch), secret, API key and bootstrap file stay as they were."""
    assert _dry_run(fileroot, "kept", "smoke.trajectories_per_worker=3").returncode == 0
    trial_dir = os.path.join(fileroot, "smoke", "kept")
    names = ("config.yaml", "secret", "api_key", "bootstrap.json")
    before = {n: open(os.path.join(trial_dir, n), "rb").read() for n in names}
    r = _dry_run(fileroot, "kept", "smoke.trajectories_per_worker=7")
    assert r.returncode == 0, r.stderr
    assert "trajectories_per_worker: 7" in r.stdout  # what it shows is the new config
    assert {n: open(os.path.join(trial_dir, n), "rb").read() for n in names} == before
    assert b"trajectories_per_worker: 3" in before["config.yaml"]


def test_a_launch_forgets_the_previous_run_outcome_and_a_dry_run_keeps_it(fileroot):
    """A launch that stops before its controller writes anything (SIGKILL, a name service that
    does not answer) leaves no earlier run's ``summary.json`` / ``status.json`` behind."""
    from system.launch import build_config
    from system.launcher.trial_dir import prepare_trial

    trial_dir = os.path.join(fileroot, "smoke", "old")
    os.makedirs(trial_dir)
    outcome = ("summary.json", "status.json")
    for name in outcome:
        with open(os.path.join(trial_dir, name), "w") as f:
            f.write('{"status": "completed", "state": "completed"}')
    cfg = build_config("smoke", "old", [f"cluster.fileroot={fileroot}"])
    prepare_trial(cfg, "smoke", "{}", dry_run=True).lock.release()
    assert all(os.path.exists(os.path.join(trial_dir, n)) for n in outcome)
    prepare_trial(cfg, "smoke", "{}").lock.release()
    assert not any(os.path.exists(os.path.join(trial_dir, n)) for n in outcome)


def _tree(root: str) -> dict[str, bytes]:
    """``{relative path: contents}`` of every file under ``root``."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_a_refused_relaunch_leaves_the_last_run_as_it_was(fileroot):
    """A relaunch refused for this machine (a CPU outside the launcher's affinity: exit 1) or
    for a config its scheduler cannot turn into jobs (3 nodes for 2 model workers: exit 2, with
    or without --detach) changes nothing in the trial directory: the completed run's
    ``summary.json`` and ``status.json`` stay (``system.ctl status`` still says completed), and
    ``config.yaml`` (read by the next ``mode=eval``) and ``secret`` are the ones it ran with."""
    trial = ("exp=smoke", "trial=done", f"cluster.fileroot={fileroot}")
    r = run_launch(*trial, "smoke.trajectories_per_worker=5")
    assert r.returncode == 0, r.stderr
    trial_dir = os.path.join(fileroot, "smoke", "done")
    before = _tree(trial_dir)
    assert {"summary.json", "status.json", "config.yaml", "secret"} <= set(before)
    slurm_nodes = ("scheduler=slurm", "scheduler.slurm.model.nodes=3", "model.count=2")
    beyond = max(os.sched_getaffinity(0)) + 1
    for refused, code, words in [
            ((f"scheduler.local.cpus.model={beyond}",), 1, "are not allowed here"),
            (slurm_nodes, 2, "scheduler.slurm.model: 3 nodes for 2 workers"),
            ((*slurm_nodes, "--detach"), 2, "scheduler.slurm.model: 3 nodes for 2 workers")]:
        r = run_launch(*trial, *refused)
        assert r.returncode == code, (refused, r.stderr)
        assert r.stderr.startswith("error: ") and words in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert _tree(trial_dir) == before, refused
    r = subprocess.run([sys.executable, "-m", "system.ctl", "status", *trial], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith("smoke/done: completed"), r.stdout + r.stderr


def test_an_existing_trial_directory_of_yours_is_tightened(fileroot):
    trial_dir = os.path.join(fileroot, "smoke", "loose")
    os.makedirs(trial_dir)
    os.chmod(trial_dir, 0o777)
    assert _dry_run(fileroot, "loose").returncode == 0
    assert stat.S_IMODE(os.stat(trial_dir).st_mode) == 0o700


@as_root
def test_a_trial_directory_created_by_someone_else_is_refused(fileroot):
    trial_dir = os.path.join(fileroot, "smoke", "theirs")
    os.makedirs(trial_dir)
    os.chown(trial_dir, OTHER_UID, OTHER_UID)
    r = _dry_run(fileroot, "theirs")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: the trial directory") and len(r.stderr.splitlines()) == 1
    assert f"owned by uid {OTHER_UID}" in r.stderr
    assert os.listdir(trial_dir) == []  # nothing written into it


def test_a_trial_directory_that_is_a_link_is_refused(fileroot, tmp_path):
    os.makedirs(os.path.join(fileroot, "smoke"))
    os.symlink(tmp_path, os.path.join(fileroot, "smoke", "link"))
    r = _dry_run(fileroot, "link")
    assert r.returncode == 1 and "symbolic link" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture
def trial_dir(tmp_path) -> str:
    d = tmp_path / "trial"
    d.mkdir(mode=0o700)
    write_secret_file(str(d))
    return str(d)


def test_the_secret_is_read_when_private(trial_dir):
    assert len(read_secret(os.path.join(trial_dir, "secret"))) == 32


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o400])
def test_a_secret_with_another_mode_is_refused(trial_dir, mode):
    os.chmod(os.path.join(trial_dir, "secret"), mode)
    with pytest.raises(UnsafeFileError, match=f"mode {mode:04o}.*must be 0600"):
        read_secret(os.path.join(trial_dir, "secret"))


@as_root
def test_a_swapped_secret_is_refused(trial_dir):
    """Someone else put their own secret in place (they would know every key)."""
    secret = os.path.join(trial_dir, "secret")
    os.unlink(secret)
    write_secret_file(trial_dir)
    os.chown(secret, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"owned by uid {OTHER_UID}"):
        read_secret(secret)


def test_a_secret_that_is_a_link_or_in_a_writable_directory_is_refused(trial_dir, tmp_path):
    secret = os.path.join(trial_dir, "secret")
    os.rename(secret, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", secret)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        read_secret(secret)
    os.unlink(secret)
    write_secret_file(trial_dir)
    os.chmod(trial_dir, 0o777)
    with pytest.raises(UnsafeFileError, match="others may write"):
        read_secret(secret)


def test_a_worker_refuses_to_start_with_a_loose_secret(trial_dir):
    from workers.base import Worker

    boot = Bootstrap(exp="e", trial="t", experiment="smoke", trial_dir=trial_dir,
                     interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
                     name_resolve_root=os.path.join(trial_dir, "nr"), rpc={}, heartbeat_ttl=2.0)
    os.chmod(os.path.join(trial_dir, "secret"), 0o644)
    with pytest.raises(UnsafeFileError, match="the trial's secret"):
        Worker(boot, 0)


HOLDER = textwrap.dedent("""
    import sys, time
    from system.launcher.trial_lock import TrialLock
    lock = TrialLock.acquire(sys.argv[1], "e/t")
    print("held", flush=True)
    sys.stdin.readline()  # hold the lock until told to go
""")


def test_the_lock_names_its_holder_and_is_free_once_it_ends(tmp_path):
    path = str(tmp_path / "lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrialLocked, match=rf"trial e/t is already running: held by pid "
                                              rf"{holder.pid} on host {os.uname().nodename}"):
            TrialLock.acquire(path, "e/t")
    finally:
        holder.kill()  # however it ends, the kernel frees the lock
        holder.wait()
    deadline = time.time() + 5
    while True:
        try:
            lock = TrialLock.acquire(path, "e/t")
            break
        except TrialLocked:
            assert time.time() < deadline
            time.sleep(0.05)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lock.release()
    TrialLock.acquire(path, "e/t").release()  # released: free again


def test_a_lock_file_that_cannot_be_written_is_named_in_one_line(tmp_path):
    """A launch on a full file system (a real tmpfs, filled) said only ``[Errno 28] No space
    left on device``: now the lock file and what to do are named, and the lock is free."""
    from system.errors import RLSystemError
    from tests.helpers import tmpfs

    with tmpfs(str(tmp_path / "fs"), "1m") as root:
        path = os.path.join(root, "lock")
        TrialLock.acquire(path, "e/t").release()  # (the lock file of an earlier run)
        with open(os.path.join(root, "filler"), "wb", buffering=0) as f:
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 65536)
        with pytest.raises(RLSystemError, match=rf"^cannot write the trial's lock file {path} "
                                                r"\(No space left on device\): make room on "
                                                r"its file system \(cluster.fileroot\)"):
            TrialLock.acquire(path, "e/t")
        os.unlink(os.path.join(root, "filler"))
        TrialLock.acquire(path, "e/t").release()  # not held by the failed attempt


def test_the_master_is_told_the_stop_grace_of_a_detached_controller_that_requeues(fileroot):
    """The detached controller of a training trial with requeue on (this launch runs in the
    trial's controller job) waits less for the checkpoint than a worker: the master fits its
    checkpoint to that wait too (``workers/checkpoint_window.py``). Any other launch: None."""
    base = ("exp=arith-tiny", f"cluster.fileroot={fileroot}", "scheduler=slurm",
            "scheduler.stop_grace=4", "--dry-run")
    for trial, extra, job_trial, grace in (("a", (), "a", 4.0),
                                           ("b", ("scheduler.slurm.requeue=false",), "b", None),
                                           ("c", (), "other", None)):
        env = {"SLURM_JOB_NAME": f"arith-tiny_{job_trial}:controller", "SLURM_JOB_ID": "7"}
        r = run_launch(*base, f"trial={trial}", *extra, env=env)
        assert r.returncode == 0, r.stderr
        boot = Bootstrap.read(os.path.join(fileroot, "arith-tiny", trial, "bootstrap.json"))
        assert boot.controller_stop_grace == grace, (trial, extra)
