"""How long Slurm leaves a job it warned or chose for preemption (the pure parts; the whole
path runs in tests/integration/test_rl_slurm.py on a real Slurm)."""
from __future__ import annotations

import pytest

from scheduler.slurm_preempt import (ASSUMED_GRACE, Preemption, chosen_at,
                                     preemption)


def _job(at=None, start=None, end=None) -> dict:
    return {"PreemptTime": at, "StartTime": start, "EndTime": end}


def test_only_a_preemption_of_the_jobs_current_run_counts():
    assert chosen_at(_job(start=1000.0), 0.0) is None
    assert chosen_at(_job(990.0, start=1000.0), 0.0) is None  # before a requeue's new start
    assert chosen_at(_job(999.5, start=1000.0), 0.0) == 999.5  # (whole seconds)
    assert chosen_at(_job(1003.0, start=1000.0), 5000.0) == 1003.0  # StartTime rules
    assert chosen_at(_job(1003.0), 1000.0) == 1003.0  # StartTime unknown: since
    assert chosen_at(_job(990.0), 1000.0) is None


@pytest.mark.parametrize("mode", ["REQUEUE", "CANCEL", "GANG,REQUEUE", ""])
def test_a_requeue_or_cancel_preemption_ends_with_the_partitions_grace(mode):
    found = preemption(_job(1000.0, 900.0), {"PreemptMode": mode, "GraceTime": "30"}, 0.0)
    assert found == Preemption(1000.0, 1030.0, 30.0)
    assert found.seconds_left(1004.0) == 26.0 and found.seconds_left(1100.0) == 0.0


def test_an_earlier_end_time_wins_and_no_grace_given_is_assumed():
    part = {"PreemptMode": "REQUEUE", "GraceTime": "60"}
    assert preemption(_job(1000.0, 900.0, 1020.0), part, 0.0).ends == 1020.0
    assert preemption(_job(1000.0, 900.0, 9000.0), part, 0.0).ends == 1060.0  # the time limit
    for part in ({"PreemptMode": "REQUEUE", "GraceTime": "0"}, {}):  # a QOS's grace, unknown
        found = preemption(_job(1000.0, 900.0), part, 0.0)
        assert found == Preemption(1000.0, 1000.0 + ASSUMED_GRACE, None)


def test_a_suspending_partition_is_left_alone():
    part = {"PreemptMode": "SUSPEND,GANG", "GraceTime": "30"}
    assert preemption(_job(1000.0, 900.0), part, 0.0) is None
    assert preemption(_job(None, 900.0), {"GraceTime": "30"}, 0.0) is None
