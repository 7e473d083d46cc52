"""Bounded-staleness admission, in the style of AReaL's staleness tests."""
from __future__ import annotations

import collections
import random
import threading

import pytest

from system.errors import ConfigError
from experiments.rl.admission import AdmissionConfig, AdmissionController, TrajectoryBuffer
from experiments.rl.data import PromptCursor, Router, TaskSource


@pytest.mark.parametrize("batch, eta, workers, want_each", [
    (8, 0, 4, 20), (8, 1, 4, 20), (8, 2, 4, 20), (16, 1, 3, 2), (4, 3, 8, 100)])
def test_admitted_is_min_of_demand_and_bound(batch, eta, workers, want_each):
    """With the trainer stalled, several rollout workers race for admission."""
    ctl = AdmissionController(AdmissionConfig(batch, eta))
    admitted = collections.Counter()

    def rollout_worker(i: int) -> None:
        for _ in range(want_each):
            if ctl.try_admit() is not None:
                admitted[i] += 1

    threads = [threading.Thread(target=rollout_worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted.values()) == min(workers * want_each, (1 + eta) * batch)
    assert ctl.outstanding() <= (1 + eta) * batch


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_no_trained_sample_exceeds_eta(eta):
    """A random interleaving of rollouts finishing out of order (some rejected, some running
    very long) and training steps."""
    rng = random.Random(eta)
    B = 6
    ctl = AdmissionController(AdmissionConfig(B, eta))
    buffer = TrajectoryBuffer(eta)
    # (_drive checks outstanding <= (1 + eta) * B after every action)
    staleness, _ = _drive(ctl, buffer, B, eta, rng, 5000)
    assert len(staleness) > 100 and max(staleness) <= eta
    if eta:
        assert max(staleness) == eta  # the bound is used, not just respected
    assert buffer.dropped < len(staleness) // 4  # oldest-first keeps drops rare


def test_buffer_serves_oldest_first_and_drops_stale():
    buf = TrajectoryBuffer(1)
    for item, version in [("a", 3), ("b", 1), ("c", 2), ("d", 3)]:
        buf.put(item, version)
    with pytest.raises(RuntimeError):  # b (version 1) is stale at version 3
        buf.take(2, 3)
    assert buf.drop_stale(3) == ["b"] and buf.dropped == 1
    assert buf.take(2, 3) == [("c", 2), ("a", 3)]
    assert buf.take(2, 3) is None and len(buf) == 1


def test_within_a_version_the_buffer_serves_by_task_order_not_arrival():
    """Rollouts finish in any order: a batch made of the same tasks is the same batch (what a
    seeded sync run needs to train the same)."""
    buf = TrajectoryBuffer(0)
    for item, seq in [("t7", 7), ("t5", 5), ("t6", 6), ("t4", 4)]:  # as they came back
        buf.put(item, 2, seq)
    assert buf.take(3, 2) == [("t4", 2), ("t5", 2), ("t6", 2)]


def test_rejected_rollouts_give_their_slot_back():
    ctl = AdmissionController(AdmissionConfig(2, 0))
    a, b = ctl.try_admit(), ctl.try_admit()
    assert ctl.try_admit() is None
    ctl.finish(a, accepted=False)
    assert ctl.try_admit() is not None
    ctl.finish(b, accepted=True)


def test_concurrency_limit_and_errors():
    ctl = AdmissionController(AdmissionConfig(100, 1, max_concurrent=3))
    tickets = [ctl.try_admit() for _ in range(5)]
    assert sum(t is not None for t in tickets) == 3
    with pytest.raises(RuntimeError):
        ctl.set_version(-1)
    with pytest.raises(RuntimeError):
        ctl.consumed(1)
    with pytest.raises(ConfigError):
        AdmissionConfig(batch_size=0)


@pytest.mark.parametrize("b,eta,workers,demand", [(4, 0, 3, 50), (4, 1, 3, 50), (8, 2, 4, 50),
                                                  (6, 1, 2, 5)])
def test_staleness_admission_with_several_rollout_workers(b, eta, workers, demand):
    """AReaL-style: with no training, admitted == min(demand, (1+eta)*B); then, training while
    rollout workers (threads) race, in-flight + buffered never exceeds (1+eta)*B and no trained
    sample is more than eta versions old."""
    adm = AdmissionController(AdmissionConfig(b, eta))
    src = TaskSource(adm, PromptCursor(list(range(1000)), 0), Router(2), group_size=1)
    got = [t for _ in range(demand) for t in src.next_task(0, 1).get("tasks", [])]
    assert len(got) == min(demand, (1 + eta) * b)

    adm = AdmissionController(AdmissionConfig(b, eta))
    src = TaskSource(adm, PromptCursor(list(range(1000)), 0), Router(2), group_size=1)
    buf, lock = TrajectoryBuffer(eta), threading.Lock()
    results: list[tuple[int, int]] = []   # (seq, version of the weights that produced it)
    version = [0]
    stop = threading.Event()
    peak = [0]

    def rollout(w: int) -> None:
        rng = random.Random(w)
        while not stop.is_set():
            reply = src.next_task(w, 2)
            for t in reply.get("tasks", []):
                with lock:
                    peak[0] = max(peak[0], adm.outstanding())
                    gen_version = version[0]  # generated with the weights current now
                stop.wait(rng.random() * 0.004)
                with lock:
                    results.append((t["seq"], gen_version))
            if "wait" in reply:
                stop.wait(0.001)

    threads = [threading.Thread(target=rollout, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    trained_lags = []
    try:
        for step in range(15):
            while True:
                with lock:
                    arrived, results[:] = list(results), []
                for seq, v in arrived:
                    src.finish(seq, accepted=True)
                    buf.put(seq, v)
                n = len(buf.drop_stale(step))
                if n:
                    adm.discard(n)
                batch = buf.take(b, step)
                if batch is not None:
                    break
                stop.wait(0.001)
            trained_lags += [step - v for _, v in batch]
            adm.consumed(b)
            with lock:
                version[0] = step + 1
            adm.set_version(step + 1)
            assert adm.outstanding() <= (1 + eta) * b
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert peak[0] <= (1 + eta) * b
    assert max(trained_lags) <= eta
    if eta == 0:
        assert set(trained_lags) == {0}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _train_with_one_leaked_task(expire: bool) -> tuple[TaskSource, list[tuple[int, int]], dict]:
    """eta = 0, B = 2: the first task handed out is answered only at the end (its rollout worker
    hung); every other one comes back a second later. Returns the source, the ``(prompt,
    epoch)`` trained, and the leaked task."""
    clock = FakeClock()
    adm = AdmissionController(AdmissionConfig(2, 0))
    src = TaskSource(adm, PromptCursor(list(range(10)), 0), Router(1), group_size=1,
                     lease_timeout=30.0, clock=clock)
    buf = TrajectoryBuffer(0)
    running: list[dict] = []
    trained: list[tuple[int, int]] = []
    leaked = None
    for _ in range(300):  # 300 s of the master's loop
        clock.now += 1.0
        for t in running:
            if src.finish(t["seq"], accepted=True) is not None:
                buf.put((t["prompt_id"], t["epoch"]), t["version"])
        running = src.next_task(0, 4).get("tasks", [])
        if leaked is None and running:
            leaked = running.pop(0)
        if expire:
            src.expire()
        batch = buf.take(2, adm.version)
        if batch is not None:
            trained += [item for item, _ in batch]
            adm.consumed(2)
            adm.set_version(adm.version + 1)
    return src, trained, leaked


def test_eta0_stalls_on_a_leaked_task_without_lease_expiry_and_recovers_with_it():
    src, trained, _ = _train_with_one_leaked_task(expire=False)
    assert src.admission.version == 0 and trained == []  # one of two slots held for good
    src, trained, leaked = _train_with_one_leaked_task(expire=True)
    assert src.admission.version >= 100 and src.expired == 1  # 30 s lost once, then ~1 step/s
    assert src.finish(leaked["seq"], accepted=True) is None  # its late group: dropped
    assert len(set(trained)) == len(trained)  # so no prompt was trained twice ...
    assert (leaked["prompt_id"], 0) in trained  # ... and the leaked one was, in its epoch


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_leases_keep_the_bound_and_train_each_prompt_once(eta):
    """Random rollouts: some run past their lease (their group arrives late), some rollout
    workers die (their leases are released; a hung one may still answer later), some fail.
    The staleness bound holds, nothing is trained twice, and training never stalls."""
    rng, clock, B, lease = random.Random(eta), FakeClock(), 4, 20.0
    adm = AdmissionController(AdmissionConfig(B, eta))
    src = TaskSource(adm, PromptCursor(list(range(30)), eta), Router(2), group_size=2,
                     lease_timeout=lease, clock=clock)
    buf = TrajectoryBuffer(eta)
    out: list[tuple[float, dict]] = []  # (when its group arrives, task)
    trained, lags = [], []
    for _ in range(4000):
        clock.now += rng.random()
        for t in src.next_task(rng.randrange(3), 2).get("tasks", []):
            slow = rng.random() < 0.1  # past its lease
            out.append((clock.now + (lease * 2 if slow else rng.random() * 5), t))
        if rng.random() < 0.01:
            src.release_worker(rng.randrange(3))  # found dead (it may still answer, late)
        src.expire()
        arrived = [t for when, t in out if when <= clock.now]
        out = [(when, t) for when, t in out if when > clock.now]
        for t in arrived:
            ok = rng.random() > 0.1
            if src.finish(t["seq"], accepted=ok) is not None and ok:
                buf.put((t["prompt_id"], t["epoch"]), t["version"])
        stale = buf.drop_stale(adm.version)
        adm.discard(len(stale))
        src.give_back(stale)
        assert adm.outstanding() <= (1 + eta) * B
        batch = buf.take(B, adm.version)
        if batch is not None:
            trained += [item for item, _ in batch]
            lags += [adm.version - v for _, v in batch]
            adm.consumed(B)
            adm.set_version(adm.version + 1)
    assert src.expired > 10 and src.released > 5
    assert len(trained) == len(set(trained)) and len(trained) > 400
    assert max(lags) <= eta
    epochs = sorted({e for _, e in trained})
    assert len(epochs) > 10
    for e in epochs[:-2]:  # finished epochs: every prompt trained exactly once
        assert sorted(p for p, ep in trained if ep == e) == list(range(30))


def _drive(ctl: AdmissionController, buffer: TrajectoryBuffer, B: int, eta: int,
           rng: random.Random, actions: int) -> tuple[list[int], list[bool]]:
    """A random interleaving of admissions, out-of-order finishes (some rejected, some running
    very long) and training steps of ``B``. Returns the trained staleness and
    whether each admission attempt succeeded; checks the bound after every action (a buffer
    restored from a larger batch size may start above it: then it must not grow)."""
    running, staleness, admitted = [], [], []
    for _ in range(actions):
        before = ctl.outstanding()
        action = rng.random()
        if action < 0.45:
            t = ctl.try_admit()
            admitted.append(t is not None)
            if t is not None:
                running.append(t)
        elif action < 0.85 and running:
            t = running.pop(rng.randrange(len(running)))
            accepted = rng.random() > 0.2
            ctl.finish(t, accepted)
            if accepted:
                buffer.put(t, t.version)
        else:
            ctl.discard(len(buffer.drop_stale(ctl.version)))
            batch = buffer.take(B, ctl.version)
            if batch is not None:
                ctl.consumed(B)
                staleness += [ctl.version - v for _, v in batch]
                ctl.set_version(ctl.version + 1)
        assert ctl.outstanding() <= max((1 + eta) * B, before)
    for t in running:  # the trial stops: nothing in flight at the checkpoint
        ctl.finish(t, accepted=False)
    return staleness, admitted


def _resume(old_b: int, new_b: int, eta: int, seed: int) -> None:
    """Train with ``old_b``, checkpoint (version, consumed, buffer), resume with ``new_b``:
    the bound holds with the new batch size and training goes on."""
    rng = random.Random(seed)
    ctl, buf = AdmissionController(AdmissionConfig(old_b, eta)), TrajectoryBuffer(eta)
    _drive(ctl, buf, old_b, eta, rng, 600)
    version, consumed = ctl.version, ctl.version * old_b
    assert version > 5 and ctl.outstanding() == len(buf)
    new, new_buf = AdmissionController(AdmissionConfig(new_b, eta)), TrajectoryBuffer(eta)
    for item, v in buf.items():
        new_buf.put(item, v)
    new.restore(version, consumed, len(buf))
    staleness, admitted = _drive(new, new_buf, new_b, eta, rng, 3000)
    assert any(admitted) and new.version > version + 20  # no hang
    assert max(staleness) <= eta
    assert new.outstanding() <= (1 + eta) * new_b


@pytest.mark.parametrize("version,consumed,new_b,eta,buffered,want", [
    (20, 20 * 16, 8, 1, 0, 16),         # B 16 -> 8: was nothing, ever (the resume hung)
    (20, 20 * 16, 8, 0, 3, 5),
    (40, 20 * 16 + 20 * 8, 8, 1, 0, 16),  # resumed again, B unchanged since the last resume
    (20, 20 * 16, 4, 2, 20, 0),          # more buffered than the new bound: train first
])
def test_restore_with_a_smaller_batch_size_admits(version, consumed, new_b, eta, buffered,
                                                   want):
    ctl = AdmissionController(AdmissionConfig(new_b, eta))
    ctl.restore(version, consumed, buffered)
    assert sum(ctl.try_admit() is not None for _ in range(1000)) == want
    assert ctl.outstanding() <= max(buffered, (1 + eta) * new_b)
    assert ctl.version == version and ctl.outstanding() == buffered + want


def test_restore_with_a_smaller_batch_size_admits_again_once_the_buffer_drains():
    ctl = AdmissionController(AdmissionConfig(4, 2))
    ctl.restore(20, 20 * 16, 20)
    assert ctl.try_admit() is None
    for step in range(21, 24):  # 20 -> 16 -> 12 -> 8 buffered
        ctl.consumed(4)
        ctl.set_version(step)
    assert sum(ctl.try_admit() is not None for _ in range(100)) == 3 * 4 - 8


@pytest.mark.parametrize("version,consumed,new_b,eta,buffered,want", [
    (20, 20 * 8, 16, 1, 0, 32),   # B 8 -> 16: was 192 admitted at once
    (20, 20 * 8, 16, 0, 5, 11),
    (10, 10 * 2, 3, 3, 0, 12),
])
def test_restore_with_a_larger_batch_size_keeps_the_bound(version, consumed, new_b, eta,
                                                          buffered, want):
    ctl = AdmissionController(AdmissionConfig(new_b, eta))
    ctl.restore(version, consumed, buffered)
    assert sum(ctl.try_admit() is not None for _ in range(1000)) == want
    assert ctl.outstanding() == (1 + eta) * new_b


@pytest.mark.parametrize("old_b,new_b,eta", [(16, 8, 1), (8, 3, 0), (6, 4, 2), (8, 16, 1),
                                             (3, 8, 0), (4, 7, 2), (6, 6, 1)])
def test_resume_with_another_batch_size_keeps_staleness_and_trains(old_b, new_b, eta):
    _resume(old_b, new_b, eta, seed=old_b * 100 + new_b * 10 + eta)


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_restore_with_the_same_batch_size_is_unchanged(eta):
    """Same B: the restored controller admits exactly what one that never stopped would."""
    B, rng = 6, random.Random(eta)
    ctl, buf = AdmissionController(AdmissionConfig(B, eta)), TrajectoryBuffer(eta)
    _drive(ctl, buf, B, eta, rng, 800)
    assert ctl.version > 5 and ctl.outstanding() == len(buf)
    new, new_buf = AdmissionController(AdmissionConfig(B, eta)), TrajectoryBuffer(eta)
    for item, v in buf.items():
        new_buf.put(item, v)
    new.restore(ctl.version, ctl.version * B, len(buf))
    assert new.outstanding() == ctl.outstanding()
    state = rng.getstate()
    kept = _drive(ctl, buf, B, eta, rng, 2000)
    rng.setstate(state)
    assert _drive(new, new_buf, B, eta, rng, 2000) == kept
    assert new.version == ctl.version and new.outstanding() == ctl.outstanding()
    fresh = AdmissionController(AdmissionConfig(B, eta))
    fresh.restore(7, 7 * B, 2)
    assert sum(fresh.try_admit() is not None for _ in range(100)) == (1 + eta) * B - 2


def test_a_restore_goes_on_numbering_tasks_where_the_checkpoint_stopped():
    """Tasks' sequence numbers (and the sampling seeds drawn from them) are not given again
    after a resume; an older checkpoint (issued 0) starts from 0 as before."""
    ctl = AdmissionController(AdmissionConfig(2, 0))
    ctl.restore(3, 6, 0, issued=9)
    assert ctl.issued == 9 and ctl.try_admit().seq == 9 and ctl.issued == 10
    ctl.restore(3, 6, 0)
    assert ctl.try_admit().seq == 0
