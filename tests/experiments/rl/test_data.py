"""The RL loop's data path without processes: prompt order, routing, the task source."""
from __future__ import annotations

import pytest

from experiments.rl.data import PromptCursor, Router, TaskSource
from experiments.rl.admission import AdmissionConfig, AdmissionController
from system.errors import ConfigError


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


def test_a_cursor_continues_only_over_its_own_prompts_and_seed():
    """Resumed over another training set, the cursor handed out ids the rollout workers did
    not have (a KeyError on every restart); over another seed, prompts twice in an epoch and
    others never. Both are refused, naming the checkpoint and the way out."""
    c = PromptCursor(list(range(14)), seed=1)
    for _ in range(5):
        c.next()
    state = c.state()
    assert state["prompts"] == 14 and state["seed"] == 1 and len(state["digest"]) == 12
    with pytest.raises(ConfigError, match=r"^rl\.seed=7: /c/step_5 drew its prompt order with "
                                          r"rl\.seed=1.*rl\.seed=1; or train a new trial from "
                                          r"its weights: rl\.model_path=/c/step_5/actor$"):
        PromptCursor(list(range(14)), seed=7).restore(state, "/c/step_5")
    for other in (list(range(6)), list(range(13, -1, -1)), [*range(13), 99]):
        with pytest.raises(ConfigError, match=r"^/c/step_5 was trained on 14 prompts \(ids "
                                              rf"{state['digest']}\), this run's training set "
                                              rf"has {len(other)} .*rl\.task\.name, train_path"):
            PromptCursor(other, seed=1).restore(state, "/c/step_5")
    same = PromptCursor(list(range(14)), seed=1)
    same.restore(state)
    assert [same.next() for _ in range(9)] == [c.next() for _ in range(9)]
    older = {k: state[k] for k in ("epoch", "pos", "redo")}  # before the fingerprint
    PromptCursor(list(range(6)), seed=7).restore(older)


def test_router_least_outstanding():
    r = Router(3)
    assert [r.pick(8) for _ in range(3)] == [0, 1, 2]
    r.done(1, 8)
    assert r.pick(8) == 1
    r.done(0, 8)
    r.done(2, 8)
    assert r.pick() == 0


def test_router_skips_servers_out_of_routing_and_no_task_goes_out_while_none_is_live():
    r = Router(3)
    r.set_live({0, 2})
    assert [r.pick(8) for _ in range(3)] == [0, 2, 0]
    adm = AdmissionController(AdmissionConfig(2, 0))
    src = TaskSource(adm, PromptCursor(list(range(4)), 1), Router(2), group_size=1)
    src.router.set_live(set())
    assert src.next_task(0, 2) == {"wait": 0.05} and adm.outstanding() == 0
    src.router.set_live({1})
    assert [t["server"] for t in src.next_task(0, 2)["tasks"]] == [1, 1]


def test_a_server_dying_while_tasks_are_handed_out_takes_no_prompt_or_slot():
    """The last live server leaves routing (the master's replica watch, another thread) while
    a rollout worker's request is served: before, the next task had already taken an
    admission slot and a prompt when the pick raised, and both were lost (the slot for good:
    with eta=0 the loop stalled)."""

    class LastServerDiesAfterOnePick(Router):
        def try_pick(self, weight: int = 1) -> int | None:
            picked = super().try_pick(weight)
            self.set_live(set())  # as the watch would, between two picks
            return picked

    adm = AdmissionController(AdmissionConfig(4, 0))
    cursor = PromptCursor(list(range(8)), 1)
    src = TaskSource(adm, cursor, LastServerDiesAfterOnePick(1), group_size=2)
    (task,) = src.next_task(0, 3)["tasks"]
    assert adm.outstanding() == 1 and src.router.outstanding == [2] and cursor.pos == 1
    src.router.set_live({0})  # it rejoined: the next prompt in order, three slots left
    (more,) = src.next_task(0, 3)["tasks"]
    assert more["prompt_id"] == cursor._order[1] and adm.outstanding() == 2


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


def test_a_filtered_group_gives_its_slot_back_but_not_its_prompt():
    """Dynamic sampling: a group of equal rewards ends its lease without being accepted, and
    its prompt was used (the next task is a new prompt, and the next epoch has it again)."""
    adm = AdmissionController(AdmissionConfig(1, 0))
    src = TaskSource(adm, PromptCursor(list(range(3)), 1), Router(1), group_size=2)
    first = src.next_task(0, 2)["tasks"]
    assert len(first) == 1  # B = 1, eta = 0: one slot
    assert src.finish(first[0]["seq"], accepted=False, redo=False) is not None
    again = src.next_task(0, 1)["tasks"]
    assert again and again[0]["prompt_id"] != first[0]["prompt_id"]
    assert adm.outstanding() == 1 and src.cursor.redo == []
    src.finish(again[0]["seq"], accepted=False, redo=False)
    third = src.next_task(0, 1)["tasks"][0]
    src.finish(third["seq"], accepted=False, redo=False)
    epoch1 = src.next_task(0, 1)["tasks"][0]
    assert epoch1["epoch"] == 1
    assert {first[0]["prompt_id"], again[0]["prompt_id"], third["prompt_id"]} == {0, 1, 2}


class FakeClock:
    """The master's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_expired_lease_frees_slot_and_load_and_redoes_prompt_in_its_epoch():
    clock = FakeClock()
    adm = AdmissionController(AdmissionConfig(2, 0))
    src = TaskSource(adm, PromptCursor(list(range(4)), 1), Router(2), group_size=3,
                     lease_timeout=10.0, clock=clock)
    a, b = src.next_task(0, 2)["tasks"]
    clock.now = 5.0
    assert src.finish(b["seq"], accepted=False) == b  # a failed rollout: b's prompt goes back
    (b2,) = src.next_task(1, 1)["tasks"]              # leased at t=5
    assert b2["prompt_id"] == b["prompt_id"]
    clock.now = 10.0
    assert src.expire() == [a]                        # a's lease (from t=0) ran out; b2 not yet
    assert src.expired == 1 and set(src.in_flight) == {b2["seq"]}
    assert src.router.outstanding == [0, 3] and adm.outstanding() == 1
    (a2,) = src.next_task(1, 5)["tasks"]              # the slot is free again: a's prompt, first
    assert (a2["prompt_id"], a2["epoch"], a2["seq"] != a["seq"]) == (a["prompt_id"], 0, True)
    assert src.finish(a["seq"], accepted=True) is None  # the late group is unknown: dropped
    assert adm.outstanding() == 2
    assert src.expire(now=14.9) == [] and src.expire(now=15.0) == [b2]
    assert src.expire(now=20.0) == [a2] and src.expired == 3 and adm.outstanding() == 0


def test_release_worker_frees_only_that_workers_leases():
    adm = AdmissionController(AdmissionConfig(4, 0))
    src = TaskSource(adm, PromptCursor(list(range(8)), 2), Router(1), group_size=1,
                     clock=FakeClock())
    dead = src.next_task(3, 2)["tasks"]
    live = src.next_task(5, 2)["tasks"]
    assert src.lease_holders() == {3, 5} and src.next_task(5, 1) == {"wait": 0.05}
    assert src.release_worker(3) == dead and src.released == 2
    assert src.lease_holders() == {5} and src.release_worker(3) == []
    redo = src.next_task(5, 4)["tasks"]               # the dead worker's prompts, at once
    assert [(t["prompt_id"], t["epoch"]) for t in redo] == [(t["prompt_id"], 0) for t in dead]
    assert [src.finish(t["seq"], True) for t in dead] == [None, None]
    assert all(src.finish(t["seq"], True) for t in live + redo)
    assert src.snapshot()["redo"] == []


def test_lease_timeout_must_be_positive():
    adm = AdmissionController(AdmissionConfig(1, 0))
    with pytest.raises(ValueError):
        TaskSource(adm, PromptCursor([0], 0), Router(1), 1, lease_timeout=0)


def test_a_restarted_rollout_worker_releases_what_its_predecessor_held():
    adm = AdmissionController(AdmissionConfig(2, 0))
    src = TaskSource(adm, PromptCursor(list(range(8)), 2), Router(1), group_size=1,
                     clock=FakeClock())
    held = src.next_task(2, 2, "first")["tasks"]
    assert src.lease_holders() == {2}
    assert src.next_task(2, 0, "first") == {"wait": 0.05}  # the same process: nothing released
    assert len(src.in_flight) == 2
    again = src.next_task(2, 2, "second")["tasks"]  # restarted: its old leases are released
    assert src.released == 2
    assert [t["prompt_id"] for t in again] == [t["prompt_id"] for t in held]
    assert all(src.finish(t["seq"], accepted=True) is None for t in held)  # late: dropped


def test_a_skipped_prompt_is_never_handed_out_again_and_the_others_keep_their_places():
    ids = list(range(6))
    plain, skipping = PromptCursor(ids, 3), PromptCursor(ids, 3)
    order = [plain.next() for _ in range(18)]
    first = skipping.next()
    skipping.give_back(4, 0)
    skipping.skip(4)  # (also out of the prompts to redo)
    rest = [skipping.next() for _ in range(14)]
    assert [first] + rest == [o for o in order if o[0] != 4][:15]
    for pid in (0, 1, 2, 3, 5):
        assert not skipping.exhausted
        skipping.skip(pid)
    assert skipping.exhausted
    with pytest.raises(ValueError):
        skipping.next()


def test_task_source_skip_ends_the_lease_and_skips_the_prompt():
    adm = AdmissionController(AdmissionConfig(2, 1))
    src = TaskSource(adm, PromptCursor([0, 1], 1), Router(1), group_size=4)
    tasks = src.next_task(0, 2)["tasks"]
    assert src.skip(tasks[0]["seq"])["prompt_id"] == tasks[0]["prompt_id"]
    assert src.skip(tasks[0]["seq"]) is None and src.router.outstanding == [4]
    other = tasks[1]["prompt_id"]
    assert {t["prompt_id"] for t in src.next_task(0, 2)["tasks"]} == {other}
    src.skip(tasks[1]["seq"])
    assert src.cursor.exhausted and src.next_task(0, 2) == {"wait": 0.05}


def test_a_resume_hands_out_the_in_flight_prompts_again_under_their_numbers():
    """Checkpointed between two sync steps, with the next step's tasks out: resumed, the master
    hands out the same prompts under the same sequence numbers (the same sampling seeds);
    with a later task already back, the numbering just goes on."""
    adm = AdmissionController(AdmissionConfig(3, 0))
    src = TaskSource(adm, PromptCursor(list(range(9)), 1), Router(1), group_size=2)
    first = src.next_task(0, 3)["tasks"]
    for t in first:
        src.finish(t["seq"], accepted=True)
    adm.consumed(3)
    adm.set_version(1)
    out = src.next_task(0, 3)["tasks"]  # the next step's, in flight at the checkpoint
    assert [t["seq"] for t in out] == [3, 4, 5] and src.resume_seq() == 3
    snap = src.snapshot()
    adm2 = AdmissionController(AdmissionConfig(3, 0))
    adm2.restore(1, 3, 0, src.resume_seq())
    cursor = PromptCursor(list(range(9)), 1)
    cursor.restore(snap)
    again = TaskSource(adm2, cursor, Router(1), group_size=2).next_task(0, 3)["tasks"]
    assert [(t["seq"], t["prompt_id"]) for t in again] == [(t["seq"], t["prompt_id"])
                                                           for t in out]
    src.finish(out[2]["seq"], accepted=True)  # a later one came back: numbers go on
    assert src.resume_seq() == 6
