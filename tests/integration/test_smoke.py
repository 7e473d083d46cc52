"""The smoke experiment end to end with real processes, and its failure paths."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import zmq

from system import names
from system.rpc import RpcClient
from workers.generation import GenerationClient
from system.bootstrap import read_secret
from system.replay import Sender
from system.sockets import endpoint
from system.wire import Channel, Codec, new_secret, recipient_id
from tests.helpers import (REPO, launch_argv, read_summary, run_launch, trial_name_resolve,
                           trial_processes)

FAST = ["controller.heartbeat_ttl=2", "scheduler.stop_grace=3"]


def _assert_nothing_left(fileroot: str, exp: str, trial: str) -> None:
    trial_dir = os.path.join(fileroot, exp, trial)
    deadline = time.time() + 5
    while trial_processes(trial_dir) and time.time() < deadline:
        time.sleep(0.1)
    assert trial_processes(trial_dir) == []


def test_smoke_end_to_end(fileroot):
    r = run_launch("exp=smoke", "trial=e2e", f"cluster.fileroot={fileroot}", *FAST)
    assert r.returncode == 0, r.stderr
    s = read_summary(fileroot, "smoke", "e2e")
    assert s["status"] == "completed"
    assert s["workers"] == {"master": 1, "model": 2, "generation": 2, "rollout": 4}
    res = s["results"]
    assert res["trajectories_received"] == res["trajectories_valid"] == 400
    assert res["per_rollout_worker"] == {str(i): 100 for i in range(4)}
    assert res["generation_requests"] == 400
    assert res["allreduce_ok"] is True and res["allreduce_values"] == [3.0, 3.0]
    assert res["reports"] == 8 and res["ping_failures"] == 0 and res["dropped_messages"] == 0, {
        k: res[k] for k in ("reports", "pings", "ping_failures", "dropped_messages")}
    trial_dir = os.path.join(fileroot, "smoke", "e2e")
    assert oct(os.stat(os.path.join(trial_dir, "secret")).st_mode & 0o777) == "0o600"
    assert len(read_secret(os.path.join(trial_dir, "secret"))) == 32
    logs = sorted(os.listdir(os.path.join(trial_dir, "logs")))
    assert logs == sorted(["launcher.log", *(f"{k}-{i}.log" for k, n in s["workers"].items()
                                             for i in range(n))])
    assert os.path.exists(os.path.join(trial_dir, "config.yaml"))
    _assert_nothing_left(fileroot, "smoke", "e2e")
    # every name-resolution key of the trial is gone
    nr = trial_name_resolve(fileroot, "smoke", "e2e")
    assert nr.find_subtree("smoke/e2e") == [] and nr.refused == 0
    # nothing the trial wrote is open to anyone else (cluster.group_readable=false)
    for top in (trial_dir, nr.root):
        for dirpath, dirs, files in os.walk(top):
            for p in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
                assert os.stat(p).st_mode & 0o077 == 0, p


@pytest.mark.redis
def test_smoke_with_redis_and_other_counts(fileroot, redis_server):
    host, port = redis_server
    r = run_launch("exp=smoke", "trial=redis", f"cluster.fileroot={fileroot}", "name_resolve=redis",
                   f"name_resolve.redis_port={port}", "rollout.count=3", "model.count=3",
                   "generation.count=1", "smoke.trajectories_per_worker=50", *FAST)
    assert r.returncode == 0, r.stderr
    res = read_summary(fileroot, "smoke", "redis")["results"]
    assert res["trajectories_valid"] == 150 and res["allreduce_values"] == [6.0] * 3
    _assert_nothing_left(fileroot, "smoke", "redis")


@pytest.mark.parametrize("mode, how", [("kill", "SIGKILL"), ("stop", "heart-beating")])
def test_crash_is_detected_named_and_cleaned_up(fileroot, mode, how):
    trial = f"crash-{mode}"
    t0 = time.time()
    # a stopped (hung) process still runs: it is judged hung after controller.hang_grace
    r = run_launch("exp=smoke", f"trial={trial}", f"cluster.fileroot={fileroot}",
                   f"smoke.crash=rollout:1:1.0:{mode}", "smoke.min_duration=60", *FAST,
                   "controller.hang_grace=3")
    elapsed = time.time() - t0
    assert r.returncode != 0
    assert "rollout/1" in r.stderr and how in r.stderr and "rollout-1.log" in r.stderr
    stacks = "every worker's threads' stacks are at the end of its log"
    if mode == "stop":
        assert "worker rollout/1: no heartbeat within 2.0s, but its process runs" in r.stderr
        assert f"nor 3s more while its process ran; {stacks})" in r.stderr
        # a hang: every worker wrote where it waited before it was stopped (SIGURG)
        logs = os.path.join(fileroot, "smoke", trial, "logs")
        with open(os.path.join(logs, "master-0.log")) as f:
            text = f.read()
        assert "every thread's stack, on request:" in text and ", in master_role\n" in text, text
        with open(os.path.join(logs, "rollout-0.log")) as f:
            assert "every thread's stack, on request:" in f.read()
    else:  # a dead process: nothing to ask
        assert stacks not in r.stderr
    s = read_summary(fileroot, "smoke", trial)
    assert s["status"] == "failed" and s["failure"]["worker"] == "rollout/1"
    # detection within 10 s of the crash (the crash is 1 s after start), the grace included
    detected = s["timeline_s"]["stopped"] - s["timeline_s"]["started"]
    assert detected < 1.0 + 10 + 3 + 2 + 3, s["timeline_s"]
    assert elapsed < 60
    _assert_nothing_left(fileroot, "smoke", trial)


def test_worker_exception_is_reported_with_traceback(fileroot):
    # the master cannot receive 100,000 trajectories within 1 s: its role raises TimeoutError,
    # which must reach the controller with the traceback text
    r = run_launch("exp=smoke", "trial=exc", f"cluster.fileroot={fileroot}",
                   "smoke.timeout=1", "smoke.min_duration=0", "rollout.count=1",
                   "smoke.trajectories_per_worker=100000", *FAST)
    assert r.returncode != 0
    assert "master/0 raised TimeoutError" in r.stderr and "Traceback" in r.stderr
    assert read_summary(fileroot, "smoke", "exc")["failure"]["worker"] == "master/0"
    _assert_nothing_left(fileroot, "smoke", "exc")


def test_ctrl_c_stops_everything(fileroot):
    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=ctrlc", f"cluster.fileroot={fileroot}",
                                        "smoke.min_duration=120", *FAST),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nr = trial_name_resolve(fileroot, "smoke", "ctrlc")
    deadline = time.time() + 60
    while len(nr.find_subtree("smoke/ctrlc/heartbeat")) < 9 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert len(trial_processes(os.path.join(fileroot, "smoke", "ctrlc"))) == 9
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "interrupted" in err
    assert read_summary(fileroot, "smoke", "ctrlc")["status"] == "interrupted"
    _assert_nothing_left(fileroot, "smoke", "ctrlc")


def test_ctrl_c_before_the_workers_register_does_not_wait_out_the_grace(fileroot):
    """Ctrl-C while the workers still import: none is registered, so none can be asked to
    stop; the launcher no longer waits ``scheduler.stop_grace`` (here 30 s) for them to end
    by themselves before their SIGTERM."""
    trial_dir = os.path.join(fileroot, "smoke", "early")
    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=early", f"cluster.fileroot={fileroot}",
                                        "smoke.min_duration=120", "controller.heartbeat_ttl=2",
                                        "scheduler.stop_grace=30"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not trial_processes(trial_dir) and time.time() < deadline:
        time.sleep(0.05)
    nr = trial_name_resolve(fileroot, "smoke", "early")
    assert nr.find_subtree("smoke/early/heartbeat") == []  # (still importing)
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.time() - t0 < 20, err  # (SIGTERM's own grace included: they end at once)
    assert proc.returncode != 0 and "interrupted" in err
    assert read_summary(fileroot, "smoke", "early")["status"] == "interrupted"
    _assert_nothing_left(fileroot, "smoke", "early")


def _state(root: str) -> str | None:
    try:
        with open(os.path.join(root, "status.json")) as f:
            return json.load(f).get("state")
    except (OSError, ValueError):
        return None


def test_a_controller_stopped_past_the_orphan_timeout_says_so(fileroot):
    """The launcher frozen (SIGSTOP: a suspended machine) longer than
    ``controller.orphan_timeout``: every worker stops itself as an orphan. Back, the controller
    names its own pause (before, each worker's exit was a failure of its own, one by one; an RL
    trial restarts every worker at once from its checkpoint, drawing on no retry)."""
    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=paused", f"cluster.fileroot={fileroot}",
                                        "smoke.min_duration=120", "controller.orphan_timeout=2",
                                        *FAST),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = os.path.join(fileroot, "smoke", "paused")
    deadline = time.time() + 120  # running: started (a pause while starting is named too)
    while _state(root) != "running" and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGSTOP)
    deadline = time.time() + 30  # key gone after its TTL (2 s), workers gone 2 s later
    while trial_processes(root) and time.time() < deadline:  # (the workers; not the launcher)
        time.sleep(0.2)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and re.match(
        r"error: the controller was stopped for \d+s, longer than controller.orphan_timeout=2s: "
        r"every worker stopped itself$", errors[0]), err[-3000:]
    _assert_nothing_left(fileroot, "smoke", "paused")


def _controlling_terminal() -> None:  # runs in the launcher between fork and exec
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_closing_the_terminal_stops_everything(fileroot):
    """The launcher runs in a terminal (a pty it controls) that goes away: the kernel hangs it
    up (SIGHUP, then every write to it fails); the trial stops like Ctrl-C, nothing is left."""
    import pty
    import select
    import threading

    master, slave = pty.openpty()
    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=tty", f"cluster.fileroot={fileroot}",
                                        "smoke.min_duration=120", *FAST),
                            cwd=REPO, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=_controlling_terminal)
    os.close(slave)
    closed = threading.Event()

    def drain() -> None:  # read the terminal, as a terminal emulator would, until it closes
        while not closed.is_set():
            if select.select([master], [], [], 0.1)[0]:
                try:
                    os.read(master, 4096)
                except OSError:
                    return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        nr = trial_name_resolve(fileroot, "smoke", "tty")
        deadline = time.time() + 60
        while len(nr.find_subtree("smoke/tty/heartbeat")) < 9 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        assert len(trial_processes(os.path.join(fileroot, "smoke", "tty"))) == 9
        closed.set()
        reader.join(5)
        os.close(master)  # the terminal window closes
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert read_summary(fileroot, "smoke", "tty")["status"] == "interrupted"
    _assert_nothing_left(fileroot, "smoke", "tty")


@pytest.mark.parametrize("signals", [(signal.SIGHUP,), (signal.SIGTERM, signal.SIGHUP)],
                         ids=["hup", "term-then-hup"])
def test_hangup_and_term_stop_everything(fileroot, signals):
    """SIGHUP (the terminal closed) and SIGTERM stop a trial like Ctrl-C; a second signal while
    the launcher is stopping the workers does not cut that short."""
    trial = "sig" + str(len(signals))
    proc = subprocess.Popen(launch_argv("exp=smoke", f"trial={trial}",
                                        f"cluster.fileroot={fileroot}", "smoke.min_duration=120",
                                        *FAST),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nr = trial_name_resolve(fileroot, "smoke", trial)
    deadline = time.time() + 60
    while len(nr.find_subtree(f"smoke/{trial}/heartbeat")) < 9 and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert len(trial_processes(os.path.join(fileroot, "smoke", trial))) == 9
    for sig in signals:
        proc.send_signal(sig)
        time.sleep(0.3)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "interrupted" in err, err
    assert "Traceback" not in err, err
    assert read_summary(fileroot, "smoke", trial)["status"] == "interrupted"
    _assert_nothing_left(fileroot, "smoke", trial)


def test_registration_timeout_names_missing_workers(fileroot):
    r = run_launch("exp=smoke", "trial=reg", f"cluster.fileroot={fileroot}",
                   "controller.register_timeout=0.05", *FAST)
    assert r.returncode != 0
    assert "did not register within" in r.stderr
    assert re.search(r"master/0: .*master-0\.log", r.stderr)
    _assert_nothing_left(fileroot, "smoke", "reg")


def test_bad_frames_to_live_worker_are_dropped_and_counted(fileroot):
    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=frames", f"cluster.fileroot={fileroot}",
                                        "smoke.min_duration=8", "rpc.max_message_bytes=1048576",
                                        *FAST),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        nr = trial_name_resolve(fileroot, "smoke", "frames")
        address = nr.wait(names.worker_address("smoke", "frames", "generation", 0), timeout=60)
        secret = read_secret(os.path.join(fileroot, "smoke", "frames", "secret"))
        codec = Codec(secret, 1 << 20)
        big = Codec(secret, 1 << 30)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(endpoint(address))

        def request(c: Codec, method: str, **args) -> list:
            return Sender(c, Channel.REQUEST).seal({"m": method, "a": args},
                                                   recipient_id(address)).frames

        raw.send_multipart([b"\x00"])                                          # truncated
        raw.send_multipart([b"A" * 80, b"\x93\x01\x02", b"tail"])              # bad tag
        raw.send_multipart(request(Codec(new_secret()), "ping"))               # other secret
        raw.send_multipart(request(big, "echo", tokens=np.zeros(1 << 16),     # oversized: two
                                   more=np.zeros(1 << 16)))                    # frames of 0.5 MB
        client = RpcClient(codec, address, timeout=10)
        deadline = time.time() + 10
        while time.time() < deadline:
            drops = client.call("ping")["drops"]
            if sum(drops.values()) >= 4:
                break
            time.sleep(0.1)
        assert drops == {"malformed": 1, "unauthenticated": 2, "oversized": 1, "replayed": 0,
                         "misdirected": 0}
        gen = GenerationClient(client, "generation/0")
        assert gen.echo(np.arange(5)).result()["server"] == 0  # still serving
        assert gen.ping().result()["kind"] == "generation"
        raw.close(0)
        client.close()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    s = read_summary(fileroot, "smoke", "frames")
    assert s["status"] == "completed" and s["results"]["dropped_messages"] == 4
    _assert_nothing_left(fileroot, "smoke", "frames")


def _close_stderr() -> None:
    os.close(2)


@pytest.mark.parametrize("where", ["full", "closed-pipe", "closed"])
def test_a_stderr_that_takes_no_output_does_not_end_the_trial(fileroot, where):
    """The launcher's stderr fails its first write (``> out.log 2>&1`` on a full disk;
    ``2>&1 | head -1`` once the reader has gone) or is not there (``2>&-``): the trial ran
    nonetheless and completed, with its records and ``launcher.log``. Before, that first
    write (the progress line) ended the launcher, its clean-up failed on the next, and the
    trial was left ``lost`` with no summary."""
    trial = "err-" + where
    argv = launch_argv("exp=smoke", f"trial={trial}", f"cluster.fileroot={fileroot}",
                       "rollout.count=1", "model.count=1", "generation.count=1",
                       "smoke.trajectories_per_worker=20", "controller.progress=true", *FAST)
    if where == "closed-pipe":
        read, write = os.pipe()
        os.close(read)  # the reader has gone: every write fails (EPIPE)
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=write)
        os.close(write)
    elif where == "full":
        with open("/dev/full", "w") as full:
            proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=full)
    else:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL,
                                preexec_fn=_close_stderr)
    try:
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert read_summary(fileroot, "smoke", trial)["status"] == "completed"
    with open(os.path.join(fileroot, "smoke", trial, "logs", "launcher.log")) as f:
        log = f.read()
    assert f"completed: {os.path.join(fileroot, 'smoke', trial)}" in log, log
    if where != "closed":
        assert "(standard error takes no more output: " in log, log
    assert "Traceback" not in log, log
    _assert_nothing_left(fileroot, "smoke", trial)
