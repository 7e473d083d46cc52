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
    running, staleness = [], []
    for _ in range(5000):
        action = rng.random()
        if action < 0.45:
            t = ctl.try_admit()
            if t is not None:
                running.append(t)
        elif action < 0.85 and running:
            t = running.pop(rng.randrange(len(running)))
            accepted = rng.random() > 0.2
            ctl.finish(t, accepted)
            if accepted:
                buffer.put(t, t.version)
        else:  # a training step on version v, then publish v + 1
            ctl.discard(len(buffer.drop_stale(ctl.version)))
            batch = buffer.take(B, ctl.version)
            if batch is not None:
                ctl.consumed(B)
                staleness += [ctl.version - v for _, v in batch]
                ctl.set_version(ctl.version + 1)
        assert ctl.outstanding() <= (1 + eta) * B
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
