"""The RL loop's parts without processes: data order, routing, admission with several rollout
workers (AReaL-style staleness test), agents, tasks, rewards, checkpoints, advantages."""
from __future__ import annotations

import json
import os
import random
import threading

import numpy as np
import pytest

from experiments.rl.agents import AgentConfig, CalculatorAgent, SingleTurnAgent, calculate
from experiments.rl.config import RLConfig
from experiments.rl.data import PromptCursor, Router, TaskSource
from experiments.rl.tasks import (TaskConfig, dataset, first_int_reward, last_int_reward,
                               load_prompts)
from experiments.rl.checkpoint import CheckpointDir
from system.errors import ConfigError
from experiments.rl.admission import AdmissionConfig, AdmissionController, TrajectoryBuffer


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


def test_calculator():
    assert calculate("3*4+2") == 14
    assert calculate("(7-9)*3") == -6
    assert calculate("8/3") == 2
    for bad in ("1/0", "__import__('os')", "2**99", "a+1", "", "9" * 20 + "*" + "9" * 20):
        assert calculate(bad) is None


class CharTok:
    """The arith-tiny tokenizer's behaviour: one character per token."""

    vocab = ["<pad>", "<s>", "</s>"] + list("0123456789+-*=[] ?()/")

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < 3))


def _drive(episode, policy):
    """Run one episode against a deterministic policy (the rollout driver's protocol)."""
    req = next(episode)
    while True:
        try:
            req = episode.send(policy(req))
        except StopIteration as s:
            return s.value


def test_calculator_agent_masks_tool_output():
    tok = CharTok()
    agent = CalculatorAgent(AgentConfig(kind="calculator", max_new_tokens=12, max_turns=3), tok)
    turns = iter(["[3*4]", "2</s>"])
    calls = []

    def policy(req):
        calls.append(req)
        text = next(turns)
        ids = tok.encode(text.replace("</s>", "")) + ([2] if text.endswith("</s>") else [])
        return [{"tokens": np.array(ids, np.int32), "logprobs": np.full(len(ids), -0.5, np.float32),
                 "versions": np.full(len(ids), len(calls), np.int32), "finish": "stop"}]

    prompt = [1] + tok.encode("3*4=")
    (traj,) = _drive(agent.episodes(prompt, 1)[0], policy)
    assert calls[0].sampling["stop_token_ids"] == [tok.encode("]")[0]]
    assert calls[1].prompt == prompt + tok.encode("[3*4]12")  # tool output appended
    comp = traj["tokens"][traj["prompt_len"]:]
    assert tok.decode(comp, skip_special_tokens=True) == "[3*4]122"
    assert traj["mask"].tolist() == [1] * 5 + [0, 0] + [1, 1]
    assert traj["versions"].tolist() == [1] * 5 + [-1, -1] + [2, 2]
    assert (traj["logprobs"][5:7] == 0).all()


def test_single_turn_agent_groups():
    agent = SingleTurnAgent(AgentConfig(max_new_tokens=3))
    (ep,) = agent.episodes([1, 2], 4)
    req = next(ep)
    assert req.n == 4 and req.sampling["max_tokens"] == 3
    s = {"tokens": np.array([5, 2], np.int32), "logprobs": np.zeros(2, np.float32),
         "versions": np.zeros(2, np.int32), "finish": "stop"}
    try:
        ep.send([s] * 4)
    except StopIteration as stop:
        trajs = stop.value
    assert len(trajs) == 4 and trajs[0]["tokens"].tolist() == [1, 2, 5, 2]
    assert SingleTurnAgent(AgentConfig()).sampling(greedy=True)["temperature"] == 0.0


def test_rewards():
    assert first_int_reward("7", 7) == 1.0 and first_int_reward(" 7+", 7) == 1.0
    assert first_int_reward("78", 7) == 0.0 and first_int_reward("+7", 7) == 0.0
    assert last_int_reward("so 3 + 4 = 7.", 7) == 1.0
    assert last_int_reward("1,200 apples", 1200) == 1.0
    assert last_int_reward("no number", 3) == 0.0


def test_generated_and_file_datasets(tmp_path):
    cfg = TaskConfig(train_size=50, eval_size=10)
    train = dataset(cfg, "train")
    assert len(train) == 50 and all(eval(p["prompt"][:-1]) == p["answer"] for p in train)
    word = TaskConfig(name="word", max_operand=9, eval_size=8)
    tr, ev = dataset(word, "train"), dataset(word, "eval")
    assert {p["prompt"] for p in tr}.isdisjoint({p["prompt"] for p in ev})
    rows = [{"prompt": "1+1=", "answer": 2, "id": None}, {"prompt": "2+2=", "answer": 4, "id": 9}]
    with open(tmp_path / "p.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    for path in ("p.jsonl", "p.parquet"):
        got = load_prompts(str(tmp_path / path))
        assert [p["answer"] for p in got] == [2, 4] and got[1]["id"] == 9
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"\.jsonl or \.parquet"):
        TaskConfig(train_path="x.csv")


def test_rl_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="rl.mode"):
        RLConfig(mode="fast")
    with pytest.raises(ConfigError, match="sync_interval"):
        RLConfig(sync_interval=3, max_head_offpolicyness=1)
    with pytest.raises(ConfigError, match="sync mode"):
        RLConfig(mode="sync", sync_interval=2)
    with pytest.raises(ConfigError, match="group_size"):
        RLConfig(group_size=1)
    assert RLConfig(mode="sync", max_head_offpolicyness=3).eta == 0


def test_checkpoint_dir_is_atomic(tmp_path):
    ck = CheckpointDir(str(tmp_path / "ck"), keep=2)
    assert ck.latest() is None
    for step in (2, 4, 6):
        d = ck.staging(step)
        open(os.path.join(d, "x"), "w").write(str(step))
        ck.commit(step, {"k": step})
    assert ck.latest() == 6
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_4", "step_6"]
    ck.staging(8)  # a crash while writing step 8: still 6
    assert ck.latest() == 6
    assert json.load(open(os.path.join(ck.path(6), "meta.json")))["step"] == 6


def test_ppo_advantages_whitened_over_policy_tokens():
    from experiments.rl.shaping import advantages_grpo, advantages_ppo

    trajs = [{"prompt_len": 2, "mask": np.array([1, 1, 0, 1], np.float32), "reward": 1.0},
             {"prompt_len": 2, "mask": np.array([1, 1], np.float32), "reward": 0.0}]
    values = [np.zeros(5, np.float32), np.zeros(3, np.float32)]
    adv, ret = advantages_ppo(trajs, values, RLConfig(algorithm="ppo"))
    assert ret[0].tolist() == [1.0, 1.0, 0.0, 1.0] and ret[1].tolist() == [0.0, 0.0]
    assert adv[0][2] == 0.0 and adv[0][0] > 0 > adv[1][0]
    g = advantages_grpo([{"reward": r, "mask": np.ones(2)} for r in (1, 0, 0, 0)], 4)
    assert g[0][0] > 0 and g[1][0] < 0 and len(g[0]) == 2


def test_reward_reads_the_final_turn():
    from experiments.rl.episodes import score

    tok = CharTok()
    prompt = [1] + tok.encode("3*4=")
    comp = tok.encode("[3*4]12") + tok.encode("12")
    traj = {"tokens": np.array(prompt + comp, np.int32), "prompt_len": len(prompt),
            "mask": np.array([1] * 5 + [0, 0] + [1, 1], np.int8)}
    score([traj], tok, 12, first_int_reward)
    assert traj["reward"] == 1.0
    single = {"tokens": np.array(prompt + tok.encode("12"), np.int32),
              "prompt_len": len(prompt), "mask": np.ones(2, np.int8)}
    score([single], tok, 12, first_int_reward)
    assert single["reward"] == 1.0
