"""Groups of workers ``first..first+count-1``: the group specs and the local scheduler's plan."""
from __future__ import annotations

import pytest

from scheduler.base import GroupSpec
from scheduler.local import LocalScheduler
from system.launcher.groups import group_spec
from system.paths import TrialPaths

# prints the index it was given both ways, then sleeps (``--index N`` lands in "$@")
ECHO_AND_SLEEP = ("sh", "-c", 'echo "$RLSYS_WORKER_INDEX $2"; exec sleep 300', "worker")


def _group(tmp_path, count: int, first: int = 0) -> GroupSpec:
    return GroupSpec("rollout", count, ECHO_AND_SLEEP, {},
                     tuple(str(tmp_path / f"rollout-{first + i}.log") for i in range(count)), first)


def test_local_plan_indexes_from_first(tmp_path):
    request = LocalScheduler().plan(_group(tmp_path, 2, first=0))
    assert [p.argv[-1] for p in request.processes] == ["0", "1"]
    request = LocalScheduler().plan(_group(tmp_path, 1, first=4))
    (proc,) = request.processes
    assert proc.name == "rollout/4" and proc.argv[-2:] == ("--index", "4")
    assert proc.env["RLSYS_WORKER_INDEX"] == "4" and proc.log_path.endswith("rollout-4.log")


def test_group_spec_first_and_attempt():
    paths = TrialPaths("/t")
    one = group_spec("generation", 1, paths, "py", attempt=2, first=3)
    assert one.first == 3 and one.worker_names() == ("generation/3",)
    assert one.log_paths == ("/t/logs/generation-3.attempt2.log",)
    whole = group_spec("generation", 2, paths, "py")
    assert whole.worker_names() == ("generation/0", "generation/1")
    assert whole.log_paths == ("/t/logs/generation-0.log", "/t/logs/generation-1.log")
    with pytest.raises(ValueError):
        GroupSpec("generation", 2, ("py",), {}, ("/only-one.log",))
