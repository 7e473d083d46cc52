"""The RL loop's data path without processes: prompt order, routing, the task source."""
from __future__ import annotations

from experiments.rl.data import PromptCursor, Router, TaskSource
from experiments.rl.admission import AdmissionConfig, AdmissionController


def test_cursor_visits_every_prompt_once_per_epoch_with_give_backs():
    c = PromptCursor(list(range(10)), seed=3)
    seen = []
    for i in range(10):
        pid, epoch = c.next()
        assert epoch == 0
        if i % 3 == 0:
            c.give_back(pid, epoch)  # lost: must come again, first, in its epoch
            assert c.next() == (pid, 0)
        seen.append(pid)
    assert sorted(seen) == list(range(10))
    pid, epoch = c.next()
    assert epoch == 1
    state = c.state()
    d = PromptCursor(list(range(10)), seed=3)
    d.restore(state)
    assert [d.next() for _ in range(5)] == [c.next() for _ in range(5)]


def test_router_least_outstanding():
    r = Router(3)
    assert [r.pick(8) for _ in range(3)] == [0, 1, 2]
    r.done(1, 8)
    assert r.pick(8) == 1
    r.done(0, 8)
    r.done(2, 8)
    assert r.pick() == 0


def test_task_source_gives_lost_prompts_back_and_snapshots_in_flight():
    adm = AdmissionController(AdmissionConfig(2, 1))
    src = TaskSource(adm, PromptCursor(list(range(6)), 1), Router(1), group_size=4)
    tasks = src.next_task(0, 3)["tasks"]
    assert len(tasks) == 3 and src.router.outstanding == [12]
    snap = src.snapshot()
    assert snap["redo"][:3] == [[t["prompt_id"], 0] for t in tasks]
    src.finish(tasks[0]["seq"], accepted=False)          # failed rollout: redo its prompt
    assert src.next_task(0, 1)["tasks"][0]["prompt_id"] == tasks[0]["prompt_id"]
    assert src.finish(999, accepted=True) is None          # unknown: ignored
    src.stop()
    assert src.next_task(0, 1) == {"done": True}
