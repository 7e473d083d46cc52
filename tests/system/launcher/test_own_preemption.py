"""The detached controller's look at its own job for a preemption (the pure parts; the whole
path runs in tests/integration/test_rl_slurm.py on a real Slurm)."""
from __future__ import annotations

import pytest

from system.launcher.own_preemption import Preemption, chosen_since, preemption


def test_only_a_preemption_since_this_run_began_counts():
    assert not chosen_since(None, 1000.0)
    assert not chosen_since(990.0, 1000.0)  # a requeued job's earlier run's
    assert chosen_since(999.5, 1000.0)  # (PreemptTime has whole seconds)
    assert chosen_since(1003.0, 1000.0)


@pytest.mark.parametrize("mode", ["REQUEUE", "CANCEL", "GANG,REQUEUE", ""])
def test_a_requeue_or_cancel_preemption_takes_the_partitions_grace(mode):
    found = preemption(1000.0, {"PreemptMode": mode, "GraceTime": "30"})
    assert found == Preemption(1000.0, 30.0)
    assert found.seconds_left(1004.0) == 26.0
    assert found.seconds_left(1100.0) == 0.0


def test_a_suspending_partition_is_left_alone_and_an_unknown_grace_is_none():
    assert preemption(1000.0, {"PreemptMode": "SUSPEND,GANG", "GraceTime": "30"}) is None
    unknown = preemption(1000.0, {})  # scontrol did not say
    assert unknown == Preemption(1000.0, None) and unknown.seconds_left(1001.0) is None
