"""The loop's side of checkpoints: where a resume starts, when a checkpoint is due."""
from __future__ import annotations

import logging
import os
import types

import pytest

from experiments.rl.checkpoint import CheckpointDir, UnreadableCheckpoints
from tests.experiments.rl.test_checkpoint import _commit


def _loop(tmp_path, recover: str = "resume", **rl):
    """An RLLoop with only what ``resume_point`` and ``checkpoint_due`` read."""
    from experiments.rl.loop import RLLoop

    loop = RLLoop.__new__(RLLoop)
    loop.master = types.SimpleNamespace(config={"recover": recover})
    loop.ckpt = CheckpointDir(str(tmp_path / "ck"))
    loop.rl = types.SimpleNamespace(**{"save_interval": 0, "save_interval_s": 60.0,
                                       "save_overhead": 0.0, "total_steps": 100, **rl})
    loop.layout = {"backend": "fsdp", "model_workers": 1, "tp": 1, "pp": 1}
    loop.state = types.SimpleNamespace(step=1)
    loop._last_save = loop._last_cost = None  # as __init__ leaves them
    return loop


def test_resume_point_skips_a_torn_checkpoint(tmp_path, caplog):
    loop = _loop(tmp_path)
    for step in (2, 4):
        _commit(loop.ckpt, step)
    os.unlink(os.path.join(loop.ckpt.path(4), "meta.json"))
    assert loop.resume_point() == 2
    assert _loop(tmp_path, recover="off").resume_point() is None
    os.unlink(os.path.join(loop.ckpt.path(2), "meta.json"))
    with pytest.raises(UnreadableCheckpoints):  # not step 0: it would prune them
        loop.resume_point()
    with caplog.at_level(logging.INFO):  # (every fresh trial: not a warning)
        assert _loop(tmp_path / "fresh").resume_point() is None
    assert any("no checkpoint" in r.getMessage() for r in caplog.records)


def test_checkpoints_are_due_by_steps_or_by_seconds(tmp_path, monkeypatch):
    import time

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    loop = _loop(tmp_path, save_interval=3, save_interval_s=60.0)
    loop.t_loop = 1000.0
    assert not loop.checkpoint_due()
    loop.state.step = 3
    assert loop.checkpoint_due()  # the step rule
    loop.state.step = 4
    now[0] = 1059.0
    assert not loop.checkpoint_due()
    now[0] = 1060.0
    assert loop.checkpoint_due()  # the time rule, counted from the loop's start
    loop._last_save = 1050.0
    assert not loop.checkpoint_due()  # ... then from the last checkpoint
    loop.rl.save_interval_s = 0
    now[0] = 5000.0
    assert not loop.checkpoint_due()


def test_the_last_step_is_checkpointed_unless_checkpoints_are_off(tmp_path, monkeypatch):
    """The trained policy is kept: mode=eval reads it, a rerun finds the trial done."""
    import time

    monkeypatch.setattr(time, "monotonic", lambda: 1000.0)
    loop = _loop(tmp_path, save_interval=7, total_steps=10)
    loop.t_loop = 1000.0
    loop.state.step = 9
    assert not loop.checkpoint_due()
    loop.state.step = 10
    assert loop.checkpoint_due()
    off = _loop(tmp_path, save_interval=0, save_interval_s=0.0, total_steps=10)
    off.t_loop, off.state.step = 1000.0, 10
    assert not off.checkpoint_due()


def test_cheap_checkpoints_are_frequent_expensive_ones_rare(tmp_path, monkeypatch):
    """rl.save_overhead: the next checkpoint is due after last cost / overhead seconds."""
    import time

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    loop = _loop(tmp_path, save_interval_s=60.0, save_overhead=0.05)
    loop.t_loop = 1000.0
    assert loop.checkpoint_due()  # the first one's cost is unknown: right after a step
    loop._last_save, loop._last_cost = 1000.0, 0.1  # a 0.1 s checkpoint: every 2 s
    now[0] = 1001.9
    assert not loop.checkpoint_due()
    now[0] = 1002.0
    assert loop.checkpoint_due()
    loop._last_cost = 10.0  # a 10 s checkpoint would be due after 200 s; 60 s caps it
    now[0] = 1059.0
    assert not loop.checkpoint_due()
    now[0] = 1060.0
    assert loop.checkpoint_due()


def test_a_preemption_request_made_while_the_checkpoint_was_taken_is_answered(tmp_path):
    """The master read the preempt keys, checkpointed and holds (no step trains after it): a
    worker warned in between (its key written after the read: the model worker, 6 ms after the
    master, in a real Slurm preemption) is answered too, not left waiting for a checkpoint that
    never comes (it used to stop without its 'checkpoint committed')."""
    from system import names
    from system.name_resolve import FileNameResolve
    from workers.master import MasterWorker

    nr = FileNameResolve(str(tmp_path / "nr"), secret=b"s" * 32)
    master = types.SimpleNamespace(name_resolve=nr, exp="e", trial="t", polls=0)
    ours, late = names.preempt("e", "t", "master", 0), names.preempt("e", "t", "model", 0)
    nr.add(ours, "1")

    def wait_stop(timeout: float) -> bool:
        master.polls += 1
        if master.polls == 1:  # the model worker's request, after the master's read
            nr.add(late, "2")
        return master.polls > 3

    master.wait_stop = wait_stop
    master.preempt_requests = lambda: MasterWorker.preempt_requests(master)
    master.preempts_checkpointed = lambda keys: MasterWorker.preempts_checkpointed(master, keys)
    loop = _loop(tmp_path)
    loop.master, loop.state = master, types.SimpleNamespace(step=43)
    with pytest.raises(RuntimeError, match="stopped after the preemption checkpoint at step 43"):
        loop.hold_for_restart(master.preempt_requests())
    assert master.preempt_requests() == []  # both answered
