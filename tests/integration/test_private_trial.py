"""Whole trials against another user of the cluster: one launcher or controller per trial (a
second launch is refused naming the first; running the same command after it ended continues
the trial), and the Redis password never lands in a file, a job script or a command line."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time

import pytest

from system.bootstrap import read_secret
from system.launch import build_config
from system.launcher.submit import controller_request
from system.name_resolve import (PASSWORD_ENV, NameResolveConfig, make_name_resolve,
                                 redis_password)
from system.errors import ConfigError, NameResolveError, UnsafeFileError
from system.paths import TrialPaths
from system.private_files import write_private
from scheduler.registry import make_scheduler
from tests.helpers import (REPO, free_port, launch_argv, read_summary, run_launch,
                           trial_name_resolve)

SMALL = ["rollout.count=1", "model.count=1", "generation.count=1",
         "smoke.trajectories_per_worker=5", "controller.heartbeat_ttl=2", "scheduler.stop_grace=3",
         "controller.progress=false"]


def test_a_second_launch_is_refused_while_the_trial_runs_and_a_rerun_after_works(fileroot):
    args = ("exp=smoke", "trial=lock", f"cluster.fileroot={fileroot}", *SMALL)
    first = subprocess.Popen(launch_argv(*args, "smoke.min_duration=60"), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        nr = trial_name_resolve(fileroot, "smoke", "lock")
        nr.wait("smoke/lock/controller", timeout=60)
        secret = read_secret(os.path.join(fileroot, "smoke", "lock", "secret"))
        for extra in ((), ("--dry-run",)):
            r = run_launch(*args, *extra)
            assert r.returncode == 1, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert (f"error: trial smoke/lock is already running: held by pid {first.pid} on "
                    f"host {socket.gethostname()}") in r.stderr
        # the refused launches wrote nothing: the running trial keeps its secret
        assert read_secret(os.path.join(fileroot, "smoke", "lock", "secret")) == secret
        assert first.poll() is None
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
        assert "interrupted" in err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    r = run_launch(*args)  # the same command again, once the first has ended
    assert r.returncode == 0, r.stderr
    assert read_summary(fileroot, "smoke", "lock")["status"] == "completed"


@pytest.fixture(scope="module")
def redis_with_password(tmp_path_factory):
    """A real redis-server that requires a password (given in a 0600 config file, so that not
    even this server's command line shows it)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it as root)")
    import redis

    password, port = secrets.token_hex(16), free_port()
    conf = str(tmp_path_factory.mktemp("redis") / "redis.conf")
    write_private(conf, (f"port {port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\n"
                         f"requirepass {password}\n").encode())
    proc = subprocess.Popen([exe, conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=password)
    for _ in range(200):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield port, password
    proc.terminate()
    proc.wait(10)


def _cmdlines_with(needle: bytes) -> list[str]:
    hits = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    hits.append(pid)
        except OSError:
            continue
    return hits


def _files_with(root: str, needle: bytes) -> list[str]:
    hits = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                if needle in f.read():
                    hits.append(os.path.join(dirpath, name))
    return hits


@pytest.mark.redis
def test_redis_password_from_a_file_is_never_written_or_on_a_command_line(
        fileroot, tmp_path, redis_with_password):
    port, password = redis_with_password
    pw_file = str(tmp_path / "redis-password")
    write_private(pw_file, (password + "\n").encode(), 0o600)
    env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
    proc = subprocess.Popen(
        launch_argv("exp=smoke", "trial=pw", f"cluster.fileroot={fileroot}", "name_resolve=redis",
                    f"name_resolve.redis_port={port}",
                    f"name_resolve.redis_password_file={pw_file}", *SMALL),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: set[str] = set()
    while proc.poll() is None:  # every process of the trial, while it runs
        seen.update(_cmdlines_with(password.encode()))
        time.sleep(0.1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert read_summary(fileroot, "smoke", "pw")["status"] == "completed"
    assert seen == set()
    assert _files_with(fileroot, password.encode()) == []
    assert password not in out + err
    with open(os.path.join(fileroot, "smoke", "pw", "config.yaml")) as f:
        assert f"redis_password_file: {pw_file}" in f.read()


@pytest.mark.redis
def test_redis_password_from_the_environment_stays_out_of_every_script(
        fileroot, redis_with_password, monkeypatch):
    port, password = redis_with_password
    monkeypatch.setenv(PASSWORD_ENV, password)
    args = ["scheduler=slurm", "name_resolve=redis", f"name_resolve.redis_port={port}",
            f"cluster.fileroot={fileroot}"]
    r = run_launch("exp=smoke", "trial=env", *args, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert os.listdir(os.path.join(fileroot, "smoke", "env", "jobs"))
    assert _files_with(fileroot, password.encode()) == []
    assert password not in r.stdout + r.stderr
    cfg = build_config("smoke", "env", args)
    paths = TrialPaths.of(fileroot, "smoke", "env")
    scheduler = make_scheduler(cfg.scheduler, "smoke", "env", paths.root)
    script = controller_request(cfg, paths, scheduler, ["exp=smoke", "trial=env", *args]).script
    assert password not in script and PASSWORD_ENV not in script
    nr = make_name_resolve(cfg.name_resolve, "", read_secret(paths.secret))  # authenticates
    nr.add("smoke/env/k", "v")
    assert nr.get("smoke/env/k") == "v"
    nr.clear_subtree("smoke/env")
    nr.close()
    monkeypatch.setenv(PASSWORD_ENV, "wrong")  # the keys to set, not "cannot reach"
    with pytest.raises(NameResolveError, match=rf"^redis at 127.0.0.1:{port} refused the "
                       r"password given \(name_resolve.redis_password_file, or "
                       rf"{PASSWORD_ENV}\)"):
        make_name_resolve(cfg.name_resolve, "", read_secret(paths.secret))
    monkeypatch.delenv(PASSWORD_ENV)
    with pytest.raises(NameResolveError, match=rf"^redis at 127.0.0.1:{port} needs a password: "
                       r"set name_resolve.redis_password_file"):
        make_name_resolve(cfg.name_resolve, "", read_secret(paths.secret))


def test_a_readable_password_file_or_a_password_on_the_command_line_is_refused(fileroot,
                                                                               tmp_path):
    pw_file = str(tmp_path / "redis-password")
    write_private(pw_file, b"hunter2\n", 0o644)
    r = run_launch("exp=smoke", "trial=loose", f"cluster.fileroot={fileroot}",
                   "name_resolve=redis", f"name_resolve.redis_password_file={pw_file}")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "mode 0644; it must be 0600 or 0400" in r.stderr and "hunter2" not in r.stderr
    with pytest.raises(UnsafeFileError):
        redis_password(NameResolveConfig(type="redis", redis_password_file=pw_file))
    write_private(pw_file, b"\n", 0o600)  # empty: it would mean no password at all
    with pytest.raises(ConfigError, match=r"redis_password_file=.* is empty"):
        redis_password(NameResolveConfig(type="redis", redis_password_file=pw_file))
    r = run_launch("exp=smoke", "trial=argv", f"cluster.fileroot={fileroot}",
                   "name_resolve=redis", "name_resolve.redis_password=hunter2")
    assert r.returncode == 2 and "hunter2" not in r.stderr
    assert "redis_password_file" in r.stderr and PASSWORD_ENV in r.stderr
    assert not os.path.exists(os.path.join(fileroot, "smoke", "argv"))
