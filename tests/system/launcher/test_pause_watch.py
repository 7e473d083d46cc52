"""Noticing that the controller's process was stopped (the real SIGSTOP: test_smoke.py)."""
from __future__ import annotations

from system.launcher.pause_watch import TICK, PauseWatch, boottime


def test_a_late_tick_is_a_pause_reported_once():
    now = [100.0]
    watch = PauseWatch(clock=lambda: now[0])
    try:
        assert watch.take() == 0.0  # (the fake clock stands still: never late)
        now[0] += 30.0  # stopped for 30 s: the first look after it sees it
        assert watch.take() == 30.0 - TICK
        assert watch.take() == 0.0  # reported once
        now[0] += TICK  # on time
        assert watch.take() == 0.0
    finally:
        watch.close()


def test_boottime_goes_forward():
    a = boottime()
    assert boottime() >= a > 0
