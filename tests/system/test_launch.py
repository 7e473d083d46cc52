"""The launcher's command line: help, field docs, one-line errors, dry runs."""
from __future__ import annotations

import os

import pytest

from system.structs import field_docs
from system.launch import build_config
from system.launcher.help import help_text
from tests.helpers import run_launch, to_a_closed_pipe


def test_field_docs_and_help():
    assert "rollout workers" in field_docs(type(build_config("smoke", "t", [])))["rollout"].lower()
    text = help_text("smoke")
    for w in ("smoke", "rollout", "count", "How many rollout workers", "crash"):
        assert w in text


@pytest.mark.parametrize("args, code, words", [
    (["exp=smoke", "trial=t", "rollout.cont=2"], 2, ["rollout.cont", "count"]),
    (["exp=smoke"], 2, ["trial"]),
    (["exp=nosuch", "trial=t"], 2, ["nosuch", "smoke"]),
    (["exp=smoke", "trial=t", "model.count=two"], 2, ["model.count", "two"]),
    (["exp=smoke", "trial=t", "scheduler=slurm", "scheduler.slurm.model.extra_sbatch=[--wait]"],
     2, ["scheduler.slurm.model.extra_sbatch[0]='--wait'", "not valid in extra_sbatch"]),
    (["exp=smoke", "trial=t", "scheduler=slurm", "scheduler.slurm.time=1"], 2,
     ["scheduler.slurm.time='1'", "scheduler.slurm.signal_seconds=120"]),
    (["exp=smoke", "trial=t", "scheduler=slurm", "scheduler.slurm.model.nodes=3",
      "model.count=2"], 2, ["scheduler.slurm.model: 3 nodes for 2 workers"]),
])
def test_cli_errors_are_one_clear_line(args, code, words, fileroot):
    r = run_launch(*args, f"cluster.fileroot={fileroot}")
    assert r.returncode == code
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ")
    assert r.stderr.count("\n") == 1, r.stderr
    assert not os.path.exists(os.path.join(fileroot, "smoke", "t")), "nothing is written"
    for w in words:
        assert w in r.stderr


def test_cli_help_and_dry_run(fileroot):
    r = run_launch("--help")
    assert r.returncode == 0 and "experiments:" in r.stdout and "smoke" in r.stdout
    r = run_launch("exp=smoke", "trial=dry", f"cluster.fileroot={fileroot}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "system.launcher.run_worker" in r.stdout and "rollout/3" in r.stdout and "nothing submitted" in r.stderr


@pytest.mark.parametrize("buffered", [True, False])
def test_help_and_dry_run_to_a_reader_that_has_gone(fileroot, buffered):
    """``--help | head`` and ``--dry-run | head`` end with exit code 0 and no message (were 1
    and a BrokenPipeError traceback)."""
    for args in (["--help"], ["exp=smoke", "--help"],
                 ["exp=smoke", "trial=dry", f"cluster.fileroot={fileroot}", "--dry-run"]):
        r = to_a_closed_pipe("system.launch", buffered, *args)
        assert r.returncode == 0 and "Error" not in r.stderr, (args, r.stderr[-2000:])


def test_launcher_and_worker_entry_do_not_import_torch():
    """The launcher and the worker entry point import the experiment catalog (every role):
    torch, transformers and vLLM load only where a role uses them (start-up time)."""
    import subprocess
    import sys

    code = ("import sys, system.launch, system.launcher.run_worker; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_stop_signals_raise_once_and_never_during_cleanup():
    """SIGTERM/SIGHUP/SIGINT raise KeyboardInterrupt once (the controller then stops everything);
    later ones, and any while the controller cleans up (SIGINT ignored), are ignored; a signal
    the process was started ignoring (nohup) stays ignored."""
    import signal

    from system.launch import STOP_SIGNALS, StopOnSignal

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
        stop = StopOnSignal()
        stop.install()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is stop and signal.getsignal(signal.SIGINT) is stop
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # a second one: ignored
        assert stop.first == "SIGTERM"

        fresh = StopOnSignal()
        fresh.install()
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what the controller does while cleaning up
        fresh(signal.SIGTERM, None)
        assert fresh.first is None
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_stop_raised_where_it_cannot_propagate_is_raised_again():
    """Ctrl-C while the local scheduler forked a worker ran the handler in the logging
    module's at-fork hook, which printed its KeyboardInterrupt as "ignored": the stop was
    lost (later signals ignored as repeats) and the trial ran to its end. The controller's
    next poll raises it again, once."""
    import signal

    from system.launch import StopOnSignal
    from system.launcher.self_requeue import ControllerRequeue

    stop = StopOnSignal()
    try:  # as an at-fork hook runs it (a hook registered here would stay for every fork)
        stop(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass  # ... and prints its exception as "ignored"
    assert stop.first == "SIGINT"
    with pytest.raises(KeyboardInterrupt, match="SIGINT"):
        stop.redeliver()
    stop.redeliver()  # once only
    requeue = StopOnSignal("41", lambda: 17.0)
    with pytest.raises(ControllerRequeue):
        requeue(signal.SIGUSR2, None)
    with pytest.raises(ControllerRequeue):  # (not yet handled: the controller handles it)
        requeue.redeliver()
    from system.launch import STOP_SIGNALS

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        handled = StopOnSignal()
        handled.install()
        with pytest.raises(KeyboardInterrupt):
            handled(signal.SIGTERM, None)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller cleans up: handled
        handled.redeliver()  # nothing raised a second time
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("args, line", [
    (["controller.heartbeat_ttl=inf"], "error: controller.heartbeat_ttl=inf: must be a finite "
                                       "number\n"),
    (["controller.heartbeat_ttl=nan"], "error: controller.heartbeat_ttl=nan: must be a finite "
                                       "number\n"),
    (["trial=u"], "error: trial given twice: trial=t and trial=u; give each key once\n"),
    (["rollout.count=2", "rollout.count=3"], "error: rollout.count given twice: rollout.count=2 "
                                             "and rollout.count=3; give each key once\n"),
])
def test_bad_values_and_repeated_keys_are_one_line(args, line, fileroot):
    """Found by a user: NaN and inf floats and a key given twice were accepted on --dry-run."""
    r = run_launch("exp=smoke", "trial=t", f"cluster.fileroot={fileroot}", *args, "--dry-run")
    assert (r.returncode, r.stderr) == (2, line)


def test_a_fileroot_that_is_not_a_directory_is_named(tmp_path):
    """Found by a user: ``cluster.fileroot=<a file>`` said ``[Errno 20] Not a directory`` with
    exit code 1, without naming the key."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for root in (afile, afile / "sub"):
        r = run_launch("exp=smoke", "trial=t", f"cluster.fileroot={root}", "--dry-run")
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"error: cluster.fileroot={root}: not a directory ("), r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_a_fileroot_where_no_directory_can_be_made_is_named(tmp_path):
    """A read-only place (a read-only directory for other users; ``/proc``, read-only even for
    root) is refused naming ``cluster.fileroot``, exit code 2."""
    root = "/proc/rlsys-no-such-dir" if os.geteuid() == 0 else str(tmp_path / "ro" / "x")
    if os.geteuid() != 0:
        os.makedirs(tmp_path / "ro", mode=0o500)
    r = run_launch("exp=smoke", "trial=t", f"cluster.fileroot={root}", "--dry-run")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: cluster.fileroot={root}: cannot create the trial "
                               "directory "), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_a_real_launch_where_the_name_service_directory_cannot_be_made_is_one_line(tmp_path):
    """Not a dry run: the name-clash check reads the file name service first, under the
    fileroot; a read-only or impossible place was a traceback (only ``PermissionError`` was
    caught)."""
    root = "/proc/rlsys-no-such-dir" if os.geteuid() == 0 else str(tmp_path / "ro" / "x")
    if os.geteuid() != 0:
        os.makedirs(tmp_path / "ro", mode=0o500)
    r = run_launch("exp=smoke", "trial=t", f"cluster.fileroot={root}")
    assert r.returncode in (1, 2), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and root in r.stderr and (
        "name_resolve.file_root" in r.stderr or "cluster.fileroot" in r.stderr), r.stderr


def test_ctrl_c_while_the_launcher_imports_is_one_line():
    """SIGINT while ``python -m system.launch`` still imports its modules (it has done
    nothing yet): ``interrupted`` and exit code 130, not a traceback through the imports."""
    import signal
    import subprocess
    import time

    from system.thread_stacks import handles_stacks_signal
    from tests.helpers import REPO, launch_argv

    proc = subprocess.Popen(launch_argv("exp=smoke", "trial=t", "--dry-run"), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not handles_stacks_signal(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.002)  # (set up first thing: the imports follow, about a second here)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err
