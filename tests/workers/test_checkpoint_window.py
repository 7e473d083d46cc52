"""How long a warned worker, and a warned detached controller, wait for the trial's checkpoint,
and the master's check that its checkpoint fits (pure)."""
from __future__ import annotations

import pytest

from workers.checkpoint_window import (PREEMPT_WAIT, WindowCheck, checkpoint_wait,
                                       controller_checkpoint_wait, controller_warning_needed,
                                       warning_needed)


@pytest.mark.parametrize("left, warning, wait", [
    (None, 0.0, PREEMPT_WAIT),    # nothing says when the job ends (the local scheduler)
    (120.0, 120.0, 90.0),         # Slurm's default warning: as before
    (30.0, 120.0, 15.0),          # a preemption's 30 s grace: half of it, not 90 s
    (600.0, 600.0, 570.0),        # a warning set for a slow checkpoint: all of it but 30 s
    (None, 600.0, 570.0),         # scontrol did not answer: the warning's length
    (None, 4.0, 2.0),
    (36000.0, 120.0, PREEMPT_WAIT),  # a SIGUSR2 sent by hand, no end near
    (0.0, 120.0, 0.0),            # the end has come: stop at once
])
def test_the_wait_is_what_slurm_leaves_less_the_stop(left, warning, wait):
    assert checkpoint_wait(left, warning) == wait


def test_the_signal_seconds_asked_for_give_the_wait_needed():
    assert [warning_needed(n) for n in (0.4, 10.0, 30.0, 30.5, 105.0)] == [1, 20, 60, 61, 135]
    for tenths in range(1, 3000, 7):
        need = tenths / 10
        warning = warning_needed(need)
        assert checkpoint_wait(None, warning) >= need
        assert warning == 1 or checkpoint_wait(None, warning - 1) < need


def test_a_checkpoint_that_outlasts_the_wait_is_said_once_with_the_key_that_fits_it():
    assert WindowCheck(0.0).check(500.0, 50.0) == ""  # no Slurm warning (the local scheduler)
    window = WindowCheck(120.0)
    assert window.check(80.0, 9.0) == ""  # 89 s of the 90 s
    note = window.check(100.0, 5.0)
    assert note == ("a step's training and its checkpoint took 5.0s + 100s: more than the 90s "
                    "a worker warned by Slurm waits for the checkpoint (scheduler.slurm."
                    "signal_seconds=120 less 30s for the stop and requeue), so a time limit "
                    "would lose the steps since the last checkpoint; valid: scheduler.slurm."
                    "signal_seconds=162 or more (a preemption's wait is what the partition's "
                    "GraceTime leaves)")  # 105 s, and a quarter more: 131.25 s, + 30 s
    assert checkpoint_wait(None, 162) >= 105 * 1.25
    assert window.check(100.0, 5.0) == "" and window.check(120.0, 12.0) == ""  # (162 waits 132)
    assert "signal_seconds=197 or more" in window.check(120.0, 13.0)  # 133 s: outgrown
    assert len(window.notes) == 2


def test_the_detached_controllers_wait_leaves_time_to_stop_every_job():
    assert controller_checkpoint_wait(120, 30.0) == 45.0
    assert controller_checkpoint_wait(120, 5.0) == 60.0  # half the warning at most
    assert controller_checkpoint_wait(30, 30.0) == 10.0
    assert controller_checkpoint_wait(27, 5.0) == 9.0  # a preemption's grace: a third of it
    assert controller_checkpoint_wait(6, 5.0) == 2.0


@pytest.mark.parametrize("grace", [0.0, 2.0, 5.0, 30.0, 120.0])
def test_the_signal_seconds_asked_for_give_the_controller_the_wait_needed(grace):
    for tenths in range(1, 4000, 7):
        need = tenths / 10
        warning = controller_warning_needed(need, grace)
        assert controller_checkpoint_wait(warning, grace) >= need
        assert warning == 1 or controller_checkpoint_wait(warning - 1, grace) < need


def test_a_detached_controller_that_requeues_itself_waits_less_and_is_fitted_too():
    """A detached controller that requeues its own job at its warning waits at most half of it
    for the checkpoint (60 s of the default 120 s, where a warned worker waits 90 s): a
    checkpoint that fits the workers' wait but not the controller's is said, with the
    signal_seconds that fits both."""
    assert WindowCheck(120.0, controller_grace=5.0).check(50.0, 9.0) == ""  # 59 s of 60 s
    window = WindowCheck(120.0, controller_grace=5.0)
    note = window.check(60.0, 5.0)
    assert WindowCheck(120.0).check(60.0, 5.0) == ""  # (the workers' 90 s: it fits)
    assert note == ("a step's training and its checkpoint took 5.0s + 60s: more than the 60s the "
                    "detached controller warned by Slurm waits for the checkpoint (half of "
                    "scheduler.slurm.signal_seconds=120, or all of it but the 25s it keeps to "
                    "stop every job and requeue itself, whichever is less, but at least a third "
                    "of it, up to 10s), so a time limit would lose the steps since the last "
                    "checkpoint; valid: scheduler.slurm."
                    "signal_seconds=163 or more (a preemption's wait is what the partition's "
                    "GraceTime leaves)")  # 65 s, and a quarter more: 81.25 s, twice over
    assert window.wait(163) >= 65 * 1.25 and window.wait(162) < 65 * 1.25
    assert window.check(60.0, 21.0) == ""  # (163 gives the controller 81.5 s)
    assert "signal_seconds=205 or more" in window.check(60.0, 22.0)  # 82 s: outgrown
    # a long stop_grace: the controller keeps 2 x 60 + 15 s, which binds before half does
    assert "signal_seconds=217 or more" in WindowCheck(120.0, 60.0).check(60.0, 5.0)
