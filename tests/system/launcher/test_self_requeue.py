"""A detached controller warned of its job's time limit (SIGUSR2): what it asks of the master,
what its requeued job runs, and what the trial's files say meanwhile. The whole path runs on
the test Slurm in tests/integration/test_rl_slurm.py."""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from experiments.catalog import get_experiment
from system import names
from system.errors import NameEntryNotFound
from system.launcher.self_requeue import (ControllerRequeue, checkpoint_first,
                                          cancelled_since, cancelled_while_requeued,
                                          end_records, own_job, requeues,
                                          restart_count, restart_overrides, stale_pending)
from system.launcher.overrides import apply_overrides
from system.name_resolve import FileNameResolve
from system.paths import TrialPaths


def _cfg(exp: str, *overrides: str):
    return apply_overrides(get_experiment(exp).make_config(), [f"exp={exp}", "trial=t",
                                                               *overrides])


def test_only_a_training_trial_on_slurm_with_requeues_requeues_its_controller():
    assert requeues(_cfg("arith-tiny", "scheduler=slurm"))
    assert requeues(_cfg("arith-tiny", "scheduler=slurm", "recover=off"))  # its own checkpoints
    assert not requeues(_cfg("arith-tiny", "scheduler=slurm", "scheduler.slurm.requeue=false"))
    assert not requeues(_cfg("arith-tiny"))  # local
    assert not requeues(_cfg("arith-tiny", "scheduler=slurm", "mode=eval"))
    assert not requeues(_cfg("smoke", "scheduler=slurm"))  # nothing to resume from


def test_a_requeued_start_resumes_what_recover_off_started():
    kept = ["exp=a", "trial=t", "rl.total_steps=9"]
    assert restart_overrides(kept) == kept
    assert restart_overrides([*kept, "recover=auto"]) == [*kept, "recover=auto"]
    assert restart_overrides([*kept, "recover.type=resume"]) == [*kept, "recover.type=resume"]
    assert restart_overrides([*kept, "recover=off", "recover.overwrite=true",
                              "recover.retries=5"]) == [*kept, "recover.retries=5",
                                                        "recover=resume"]
    assert restart_overrides(["recover.type=OFF", *kept]) == [*kept, "recover=resume"]
    assert _cfg("arith-tiny", *restart_overrides(["recover=off", "recover.overwrite=true"])
                ).recover.type.value == "resume"


def test_own_job_and_restart_count(monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NAME", "arith-tiny_t:model")
    assert own_job("arith-tiny", "t") is None and restart_count() == 0
    monkeypatch.setenv("SLURM_JOB_NAME", "arith-tiny_t:controller")
    assert own_job("arith-tiny", "t") == "41" and own_job("arith-tiny", "u") is None
    for raw, count in (("2", 2), ("x", 0), ("-1", 0)):
        monkeypatch.setenv("SLURM_RESTART_COUNT", raw)
        assert restart_count() == count


def test_checkpoint_first_waits_for_the_master_to_delete_its_key(tmp_path):
    nr = FileNameResolve(str(tmp_path / "nr"), secret=b"s" * 32)
    key = names.preempt("e", "t", "controller", 0)

    def master() -> None:  # what the RL loop does: checkpoint, then delete the key
        while True:
            try:
                nr.get(key)
                break
            except NameEntryNotFound:
                time.sleep(0.05)
        time.sleep(0.3)
        nr.delete(key)

    thread = threading.Thread(target=master)
    thread.start()
    assert checkpoint_first(nr, "e", "t", timeout=10.0)
    thread.join()
    t0 = time.monotonic()  # nobody deletes it: given up after the timeout, the key left
    assert not checkpoint_first(nr, "e", "t", timeout=0.6)
    assert 0.5 < time.monotonic() - t0 < 5.0 and nr.get(key)
    t0 = time.monotonic()  # the master ended (preempted itself): not waited for
    assert not checkpoint_first(nr, "e", "t", timeout=30.0, gone=lambda: True)
    assert time.monotonic() - t0 < 5.0


def test_a_refused_requeue_rewrites_the_records(tmp_path):
    paths = TrialPaths(str(tmp_path))
    for path, record in ((paths.summary, {"status": "requeued", "steps": 3}),
                         (paths.status, {"state": "pending", "jobs": []})):
        with open(path, "w") as f:
            json.dump(record, f)
    assert stale_pending(paths)
    end_records(paths, "interrupted", "not requeued: Requested operation is presently disabled")
    with open(paths.summary) as f:
        assert json.load(f) == {
            "status": "interrupted", "steps": 3,
            "requeue_note": "not requeued: Requested operation is presently disabled"}
    with open(paths.status) as f:
        assert json.load(f)["state"] == "interrupted"
    assert not stale_pending(paths)


def test_a_cancel_since_the_start_stops_the_requeue(tmp_path):
    paths = TrialPaths(str(tmp_path))
    assert not cancelled_since(paths, 100.0)
    with open(paths.cancel_request, "w") as f:
        json.dump({"time": 99.0, "user": "u"}, f)
    assert not cancelled_since(paths, 100.0)  # a request to an earlier run
    assert cancelled_since(paths, 98.5)
    assert not cancelled_while_requeued(paths)  # (no summary)
    for status, t0, cancelled in (("requeued", 98.5, True), ("requeued", 100.0, False),
                                  ("completed", 98.5, False)):
        with open(paths.summary, "w") as f:
            json.dump({"status": status, "t0_epoch": t0}, f)
        assert cancelled_while_requeued(paths) is cancelled


def test_sigusr2_raises_controller_requeue_only_for_a_requeuing_controller():
    from system.launch import STOP_SIGNALS, StopOnSignal

    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        StopOnSignal().install()
        with pytest.raises(KeyboardInterrupt) as plain:  # a stop, as at a time limit
            signal.raise_signal(signal.SIGUSR2)
        assert not isinstance(plain.value, ControllerRequeue)
        StopOnSignal("41").install()
        with pytest.raises(ControllerRequeue) as e:
            signal.raise_signal(signal.SIGUSR2)
        assert str(e.value) == "41" and e.value.seconds_left() is None  # (signal_seconds)
        StopOnSignal("41", lambda: 17.0).install()  # the grace a preemption leaves
        with pytest.raises(ControllerRequeue) as e:
            signal.raise_signal(signal.SIGUSR2)
        assert str(e.value) == "41" and e.value.seconds_left() == 17.0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
