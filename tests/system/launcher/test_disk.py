"""A full file system as a failure's cause: the pure rule, and the sizes it reads (the full
disk itself, a real tmpfs, is in tests/integration/test_full_disk.py)."""
from __future__ import annotations

import os

from system.errors import WorkerFailure
from system.launcher.disk import MIN_FREE, FullDisk, checkpoint_sizes, full_disk_cause, \
    judge_space


def test_judge_space():
    assert judge_space(0, 0) and judge_space(MIN_FREE - 1, 0)
    assert not judge_space(MIN_FREE, 0)
    assert judge_space(MIN_FREE + 100, 101) and not judge_space(MIN_FREE + 100, 100)


def test_largest_checkpoint_counts_committed_and_staged(tmp_path):
    root = tmp_path / "checkpoints"
    assert checkpoint_sizes(str(root)) == (0, 0)
    for name, sizes in (("step_2", (10, 20)), ("step_4.tmp", (50,))):
        os.makedirs(root / name / "actor")
        for i, n in enumerate(sizes):
            (root / name / "actor" / f"f{i}").write_bytes(b"x" * n)
    (root / "latest").write_text("2")
    assert checkpoint_sizes(str(root)) == (50, 50)  # the largest; the staged (a restart
    # removes it: its space counts as free)


def test_a_failure_with_space_left_is_left_as_it_is(tmp_path):
    failure = WorkerFailure("worker master/0 exited", "master/0", "/log")
    assert full_disk_cause(failure, str(tmp_path), str(tmp_path / "checkpoints")) is failure
    # /proc: a file system with no space at all
    named = full_disk_cause(failure, "/proc", "/proc/no-checkpoints")
    assert isinstance(named, FullDisk) and named.config and named.worker == "master/0"
    assert str(named).startswith("the file system of the trial directory /proc is full (0.0 MiB")
    assert str(named).endswith("\nthen worker master/0 exited")
    timeout = WorkerFailure("controller.timeout reached")  # no worker: not the disk's doing
    assert full_disk_cause(timeout, "/proc", "/proc/no-checkpoints") is timeout
    named = FullDisk("the file system ... is full", "master/0", "/log", config=True)
    assert full_disk_cause(named, str(tmp_path), str(tmp_path)) is named
