"""Dynamic sampling in the master's loop (``RLLoop.next_batch``) with its real admission,
task source, buffer and filter: the stream below plays rollout workers that answer every
task handed out, some with groups of equal rewards."""
from __future__ import annotations

import types

import numpy as np

from experiments.rl.admission import AdmissionConfig, AdmissionController, TrajectoryBuffer
from experiments.rl.agent_failures import AgentFailures
from experiments.rl.data import PromptCursor, Router, TaskSource
from experiments.rl.group_filter import UniformGroups
from experiments.rl.state import LoopState


def traj(reward: float, version: int = 0) -> dict:
    return {"tokens": np.arange(4), "prompt_len": 2, "mask": np.ones(2, np.int8),
            "logprobs": np.full(2, -0.5, np.float32), "versions": np.full(2, version),
            "reward": reward}


class Stream:
    """Answers each task the source hands out: prompts in ``uniform`` get equal rewards."""

    def __init__(self, source: TaskSource, uniform: set[int]) -> None:
        self.source, self.uniform, self.sent = source, uniform, []

    def recv(self, timeout: float) -> dict | None:
        reply = self.source.next_task(0, 1)
        if not reply.get("tasks"):
            return None
        t = reply["tasks"][0]
        rewards = [1.0, 1.0] if t["prompt_id"] in self.uniform else [1.0, 0.0]
        self.sent.append(t["prompt_id"])
        return {"seq": t["seq"], "prompt_id": t["prompt_id"], "worker": 0, "server": 0,
                "trajs": [traj(r, t["version"]) for r in rewards], "failed": False, "error": "",
                "unservable": False, "agent_error": False}


def loop(prompts: int, batch: int, uniform: set[int], enabled: bool = True,
         max_batches: int = 10):
    from experiments.rl.loop import RLLoop

    lp = RLLoop.__new__(RLLoop)
    lp.rl = types.SimpleNamespace(batch_size=batch, agent=types.SimpleNamespace(function=""))
    lp.state = LoopState()
    lp.admission = AdmissionController(AdmissionConfig(batch, 0))
    lp.buffer = TrajectoryBuffer(0)
    lp.source = TaskSource(lp.admission, PromptCursor(list(range(prompts)), 1), Router(1), 2)
    lp.uniform = UniformGroups(enabled, batch, max_batches)
    lp.agent_failures = AgentFailures(batch)
    progress: dict = {}
    lp.master = types.SimpleNamespace(stopping=False, progress=lambda: dict(progress),
                                      set_progress=lambda **f: progress.update(f))
    lp.reclaim_leases = lp.watch_replicas = lambda *a, **k: None
    lp.preempt_requests = lambda: []
    lp.puller = Stream(lp.source, uniform)
    return lp


def test_a_batch_holds_only_groups_with_a_signal_and_filtered_slots_reopen():
    lp = loop(prompts=12, batch=3, uniform={0, 2, 4, 6, 8, 10})
    got = lp.next_batch()
    trained = [int(a.group["prompt_id"]) for a, _ in got]
    assert len(trained) == 3 and all(p % 2 for p in trained)
    filtered = [p for p in lp.puller.sent if p % 2 == 0]
    assert lp.uniform.filtered == len(filtered) > 0
    # the filtered prompts were used (not redone): the epoch goes on with fresh ones
    assert lp.source.cursor.redo == [] and lp.admission.outstanding() == 3
    assert lp.master.progress()["filtered"] == len(filtered)  # (the live line)
    assert len(set(lp.puller.sent)) == len(lp.puller.sent)


def test_without_dynamic_sampling_groups_of_equal_rewards_are_trained():
    lp = loop(prompts=12, batch=3, uniform=set(range(12)), enabled=False)
    assert len(lp.next_batch()) == 3 and lp.uniform.filtered == 0


def test_a_step_past_its_budget_trains_on_what_comes():
    """A training set with no signal left (the task is solved): the step filters its budget,
    then fills its batch with groups as they come (it does not sample for ever)."""
    lp = loop(prompts=50, batch=2, uniform=set(range(50)), max_batches=3)
    got = lp.next_batch()
    assert len(got) == 2 and lp.uniform.filtered == 6
    sent = lp.puller.sent
    assert len(sent) == len(set(sent)) == 8  # (each prompt once, none redone)
    lp.admission.consumed(2)  # (what a step does after training on it)
    lp.admission.set_version(1)
    lp.state.step = 1
    lp.next_batch()
    assert lp.uniform.filtered == 12  # (the next step filters afresh)


def test_a_lease_released_meanwhile_is_neither_trained_nor_counted():
    """A group whose lease was released (its rollout worker restarted) is a leftover: neither
    filtered nor counted, its prompt redone under the new lease."""
    lp = loop(prompts=12, batch=1, uniform=set(range(11)))  # (only prompt 11 has a signal)
    stream = lp.puller
    real, done = stream.recv, []

    def released(timeout):
        msg = real(timeout)
        if msg is not None and not done and msg["prompt_id"] in stream.uniform:
            lp.source.release_worker(0)  # before the master reads it (once)
            done.append(msg["prompt_id"])
        return msg
    stream.recv = released
    got = lp.next_batch()
    uniform = [p for p in stream.sent if p in stream.uniform]
    assert lp.uniform.filtered == len(uniform) - 1 and len(uniform) == len(set(uniform)) + 1
    assert int(got[0][0].group["prompt_id"]) == 11
