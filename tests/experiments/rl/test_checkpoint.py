"""Checkpoint directories: atomic commits, verification, falling back past a torn checkpoint."""
from __future__ import annotations

import json
import logging
import os
import struct
import types

import pytest

from experiments.rl.checkpoint import CheckpointDir, CorruptCheckpoint, UnreadableCheckpoints
from experiments.rl.roles.model import resume_dir_of
from system.digests import file_digest


def _commit(ck: CheckpointDir, step: int) -> str:
    d = ck.staging(step)
    os.makedirs(os.path.join(d, "actor"))
    open(os.path.join(d, "x"), "w").write(str(step))
    with open(os.path.join(d, "actor", "config.json"), "w") as f:
        json.dump({"step": step}, f)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    with open(os.path.join(d, "actor", "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    return ck.commit(step, {"k": step})


def test_checkpoint_dir_is_atomic(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    assert ck.latest() is None
    for step in (2, 4, 6):
        _commit(ck, step)
    assert ck.latest() == 6
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_4", "step_6"]
    ck.staging(8)  # a crash while writing step 8: still 6
    assert ck.latest() == 6
    meta = json.load(open(os.path.join(ck.path(6), "meta.json")))
    assert meta["step"] == 6 and meta["files"]["actor/config.json"] > 0
    assert "meta.json" not in meta["files"]


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)


def _garble(path: str) -> None:  # same size, bytes changed
    with open(path, "r+b") as f:
        f.write(b"\xff\xfe{")


def _header_byte(path: str, after: bytes, new: bytes) -> None:
    """Change one byte of a safetensors header, after ``after`` (valid JSON still)."""
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(data.index(after) + len(after))
        f.write(new)


@pytest.mark.parametrize("tear", [
    lambda d: os.unlink(os.path.join(d, "meta.json")),
    lambda d: open(os.path.join(d, "meta.json"), "w").write('{"step": 4, "fi'),
    lambda d: os.unlink(os.path.join(d, "actor", "config.json")),
    lambda d: _truncate(os.path.join(d, "x")),
    lambda d: _garble(os.path.join(d, "actor", "config.json")),
    lambda d: _garble(os.path.join(d, "actor", "model.safetensors")),
    # (a KeyError out of the check: the launch, and mode=eval, ended in a traceback)
    lambda d: _header_byte(os.path.join(d, "actor", "model.safetensors"), b"data_offse", b"z"),
    lambda d: _header_byte(os.path.join(d, "actor", "model.safetensors"), b'"data_offsets": ',
                           b'"'),
], ids=["no-meta", "torn-meta", "missing-file", "short-file", "corrupt-json",
        "corrupt-safetensors", "safetensors-no-offsets", "safetensors-offsets-no-list"])
def test_a_torn_newest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog, tear):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    _commit(ck, 2)
    tear(_commit(ck, 4))
    assert open(tmp_path / "ck" / "latest").read() == "4"  # the pointer names the torn one
    with caplog.at_level(logging.WARNING, logger="rl-checkpoint"):
        assert ck.latest() == 2
        assert ck.latest() == 2  # (a launch asks several times: one warning)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"checkpoint {ck.path(4)} is unreadable"]
    assert caplog.records[0].getMessage().endswith(": falling back to step 2")


def test_checkpoints_none_of_which_reads_are_refused_not_started_over(tmp_path, caplog):
    """With every checkpoint unreadable, a resume started from the base model and its first
    commit deleted them all. Now the trial is refused, the checkpoints are left as they are,
    and each is named once however often a process asks."""
    ck = CheckpointDir(str(tmp_path / "ck"), keep=0)
    for step in (9, 10):
        _commit(ck, step)
    for step in (9, 10):
        _truncate(os.path.join(ck.path(step), "x"))
    with caplog.at_level(logging.WARNING, logger="rl-checkpoint"):
        for _ in range(3):
            with pytest.raises(UnreadableCheckpoints) as e:
                ck.latest()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"none of the 2 checkpoint(s) in {ck.root} ")
    assert "step_10: x: 1 bytes, committed with 2" in msg and "step_9: " in msg
    assert "recover=off recover.overwrite=true" in msg
    assert not caplog.records  # the error names them: no warning of a fallback that is none
    assert ck.steps() == [10, 9]


def test_commit_after_a_fallback_replaces_the_abandoned_timeline(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    for step in (2, 4):
        _commit(ck, step)
    os.unlink(os.path.join(ck.path(4), "meta.json"))
    assert ck.latest() == 2
    _commit(ck, 3)  # the resumed run's first checkpoint: step_4 belongs to the crashed run
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_2", "step_3"]
    _commit(ck, 5)
    assert ck.steps() == [5, 3] and ck.latest() == 5


def test_only_readable_checkpoints_count_towards_keep(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    for step in (2, 4):
        _commit(ck, step)
    _truncate(os.path.join(ck.path(4), "x"))
    _commit(ck, 6)  # keeps 6 and the readable 2; the broken 4 cannot be a fallback
    assert ck.steps() == [6, 2]


def test_no_checkpoint_at_all(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"))
    d = ck.staging(2)  # staged, never committed
    open(os.path.join(d, "x"), "w").write("2")
    assert ck.latest() is None


def test_discard_staging_keeps_committed_checkpoints(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"))
    _commit(ck, 2)
    d = ck.staging(4)  # a checkpoint a full disk cut short
    open(os.path.join(d, "x"), "w").write("4")
    ck.discard_staging()
    assert sorted(os.listdir(ck.root)) == ["latest", "step_2"] and ck.latest() == 2


def _flip_data_byte(path: str) -> None:
    """Change one byte of a safetensors file's tensor data: size and structure still check."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 3)
        f.write(b"\x01")


def test_commit_records_every_file_s_digest_the_writers_given_ones_as_given(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"))
    d = ck.staging(2)
    open(os.path.join(d, "x"), "w").write("2")
    open(os.path.join(d, "y"), "w").write("22")
    ck.commit(2, {}, digests={"x": "crc32:0000abcd"})  # (what the model workers reported)
    meta = json.load(open(os.path.join(ck.path(2), "meta.json")))
    assert meta["digests"] == {"x": "crc32:0000abcd", "y": file_digest(os.path.join(ck.path(2),
                                                                                   "y"))}


def test_a_change_that_keeps_size_and_structure_is_found_by_one_rank_and_marked(tmp_path,
                                                                                 caplog):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    _commit(ck, 2)
    _flip_data_byte(os.path.join(_commit(ck, 4), "actor", "model.safetensors"))
    assert ck.latest() == 4  # what a launch checks cheaply cannot see it
    with caplog.at_level(logging.ERROR, logger="rl-checkpoint"):
        found = [ck.check_content(4, rank, 3) for rank in range(3)]
    (problem,) = [p for p in found if p is not None]
    assert problem.startswith("actor/model.safetensors: content differs from what was written")
    assert f"checkpoint {ck.path(4)} is corrupt" in caplog.text
    with caplog.at_level(logging.WARNING, logger="rl-checkpoint"):
        assert ck.latest() == 2  # every process skips it from now on
    assert f"marked corrupt: {problem}" in caplog.text
    assert [ck.check_content(2, rank, 3) for rank in range(3)] == [None] * 3


def test_a_checkpoint_written_without_digests_has_nothing_to_check(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"))
    _commit(ck, 2)
    meta_path = os.path.join(ck.path(2), "meta.json")
    meta = json.load(open(meta_path))
    del meta["digests"]  # (as before digests were written)
    json.dump(meta, open(meta_path, "w"))
    _flip_data_byte(os.path.join(ck.path(2), "actor", "model.safetensors"))
    assert ck.check_content(2, 0, 1) is None and ck.latest() == 2


def test_a_model_worker_refuses_a_corrupt_checkpoint_and_the_restart_takes_the_one_before(
        tmp_path):
    """What each model rank does before it builds its engines (``resume_dir_of``)."""
    ck = CheckpointDir(str(tmp_path / "trial" / "checkpoints"))
    _commit(ck, 2)
    _flip_data_byte(os.path.join(_commit(ck, 4), "actor", "model.safetensors"))
    ranks = [types.SimpleNamespace(config={"recover": "resume"}, index=r, world_size=2,
                                   boot=types.SimpleNamespace(trial_dir=str(tmp_path / "trial")))
             for r in range(2)]
    with pytest.raises(CorruptCheckpoint, match=r"step_4 is corrupt \(actor/model.safetensors: "
                       r"content differs .*\): it is marked so, and a restart resumes from"):
        for worker in ranks:
            resume_dir_of(worker)  # type: ignore[arg-type]
    assert [resume_dir_of(w) for w in ranks] == [ck.path(2)] * 2  # type: ignore[arg-type]


def test_the_master_checks_its_own_state_alone_and_marks_a_corrupt_one(tmp_path):
    """The master checks the files it reads itself (``only``: its state, small) before it
    decodes them. It left them to the model workers, whose share takes minutes on a real
    model: a corrupt state failed the master within seconds, the model workers were stopped
    before they were done, and every recovery failed alike with the checkpoint never
    marked."""
    ck = CheckpointDir(str(tmp_path / "ck"))
    _commit(ck, 2)
    step4 = _commit(ck, 4)
    _flip_data_byte(os.path.join(step4, "actor", "model.safetensors"))  # not the master's
    assert ck.restorable(4, only=("x",)) == step4
    with open(os.path.join(step4, "x"), "r+b") as f:
        f.write(b"9")
    with pytest.raises(CorruptCheckpoint, match=r"step_4 is corrupt \(x: content differs "
                                                r".*\): it is marked so, and a restart"):
        ck.restorable(4, only=("x",))
    assert ck.latest() == 2


def test_a_reader_checks_one_folder_and_may_leave_the_checkpoint_unmarked(tmp_path):
    """What ``mode=eval`` does before it loads a checkpoint's ``actor/`` into the servers (it
    writes nothing of the evaluated trial)."""
    ck = CheckpointDir(str(tmp_path / "ck"))
    step2 = _commit(ck, 2)
    _flip_data_byte(os.path.join(step2, "actor", "model.safetensors"))
    problem = ck.check_content(2, under="actor", mark=False)
    assert problem.startswith("actor/model.safetensors: content differs")
    assert ck.latest() == 2 and not os.path.exists(os.path.join(ck.path(2), "CORRUPT"))
    _commit(ck, 4)
    with open(os.path.join(ck.path(4), "x"), "r+b") as f:
        f.write(b"9")
    assert ck.check_content(4, under="actor/", mark=False) is None  # x is not under actor/
    assert ck.check_content(4).startswith("x: content differs")
