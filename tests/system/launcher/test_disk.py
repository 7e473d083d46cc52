"""A full file system as a failure's cause: the pure rule, and the sizes it reads (the full
disk itself, a real tmpfs, is in tests/integration/test_full_disk.py)."""
from __future__ import annotations

import errno
import os

import pytest

from system.errors import WorkerFailure
from system.launcher.disk import MIN_FREE, FullDisk, checkpoint_sizes, full_disk_cause, \
    judge_space, space_cause, write_refused
from tests.helpers import tmpfs


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


def test_space_cause_names_a_full_file_system_a_refused_write_or_a_quota_in_the_report():
    plenty = 10 * MIN_FREE
    assert space_cause("/r", plenty, 0, 0, None, "worker raised ValueError") is None
    assert space_cause("/r", 0, 0, 0, None, "").startswith(
        "the file system of the trial directory /r is full (0.0 MiB free")
    assert space_cause("/r", MIN_FREE, MIN_FREE, MIN_FREE, None, "") is None  # staged counts
    # space a quota withholds: statvfs shows plenty, a write is refused
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))
    assert space_cause("/r", plenty, 0, 0, quota, "") == (
        "writing under the trial directory /r fails: Disk quota exceeded (the file system "
        "shows 160.0 MiB free: a quota, or its inodes, are used up): free space or raise the "
        "quota")
    other = OSError(errno.ENOENT, os.strerror(errno.ENOENT))  # not a matter of space
    assert space_cause("/r", plenty, 0, 0, other, "") is None
    # not writable at all (a read-only mount, an immutable or another user's directory)
    for code in (errno.EACCES, errno.EPERM, errno.EROFS):
        refused = OSError(code, os.strerror(code), "/r/checkpoints/.space-probe-x")
        assert space_cause("/r", plenty, 0, 0, refused, "") == (
            "the workers cannot write under the trial directory: /r/checkpoints refuses a new "
            f"file ({os.strerror(code)}): make it writable by the trial's user")
    reported = "worker model/0 raised OSError: [Errno 122] Disk quota exceeded: '/h/x'"
    assert space_cause("/r", plenty, 0, 0, None, reported).startswith(
        "a worker failed with 'Disk quota exceeded': a quota is used up")
    # "No space left" from elsewhere (/dev/shm, say) with the trial's disk roomy: not named
    assert space_cause("/r", plenty, 0, 0, None, "[Errno 28] No space left on device") is None


def test_a_reported_quota_is_named_and_not_recovered(tmp_path):
    failure = WorkerFailure("worker model/0 raised OSError: [Errno 122] Disk quota exceeded\n"
                            "Traceback ...", "model/0", "/log")
    named = full_disk_cause(failure, str(tmp_path), str(tmp_path / "checkpoints"))
    assert isinstance(named, FullDisk) and named.config and named.worker == "model/0"
    assert str(named).endswith("then worker model/0 raised OSError: [Errno 122] Disk quota "
                               "exceeded")
    assert os.listdir(tmp_path) == []  # the probe write left nothing


@pytest.fixture
def half_full_fs(tmp_path):
    with tmpfs(str(tmp_path / "fs"), "1m") as root:
        with open(os.path.join(root, "data"), "wb") as f:
            f.write(bytes(512 << 10))  # half of it
        yield root


def test_write_refused_is_the_error_of_a_real_write(half_full_fs, tmp_path):
    assert write_refused(str(tmp_path)) is None and os.listdir(tmp_path) == ["fs"]
    assert write_refused(str(tmp_path / "absent")) is None
    refused = write_refused(half_full_fs)  # 1 MiB does not fit in the half left
    assert refused is not None and refused.errno == errno.ENOSPC
    assert os.listdir(half_full_fs) == ["data"]  # the probe file is removed either way


def test_a_trial_directory_that_cannot_be_written_is_named_and_not_recovered(tmp_path):
    """A read-only checkpoints directory failed every checkpoint, and each of the recoveries
    failed the same way before the trial ended (about 47 s of restarts)."""
    import subprocess

    with tmpfs(str(tmp_path / "fs"), "64m") as root:  # (room enough: not full)
        os.makedirs(os.path.join(root, "checkpoints", "step_2"))
        subprocess.run(["mount", "-o", "remount,ro", root], check=True)
        failure = WorkerFailure("worker master/0 raised OSError: [Errno 30] Read-only file "
                                f"system: '{root}/checkpoints/step_4.tmp'", "master/0", "/log")
        named = full_disk_cause(failure, root, os.path.join(root, "checkpoints"))
        assert isinstance(named, FullDisk) and named.config and named.worker == "master/0"
        assert str(named).startswith(f"the workers cannot write under the trial directory: "
                                     f"{root}")
        assert "(Read-only file system): make it writable" in str(named)
    # writable again: the same failure is left as it is
    failure = WorkerFailure("worker master/0 raised ValueError: x", "master/0", "/log")
    assert full_disk_cause(failure, str(tmp_path), str(tmp_path / "checkpoints")) is failure
