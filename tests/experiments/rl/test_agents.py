"""Agents: the calculator tool, multi-turn masking of tool output, single-turn groups."""
from __future__ import annotations

import numpy as np

from experiments.rl.agents import (AgentConfig, CalculatorAgent, SingleTurnAgent, calculate,
                                   request_seed, task_seed)
from tests.helpers import CharTok


def test_calculator():
    assert calculate("3*4+2") == 14
    assert calculate("(7-9)*3") == -6
    assert calculate("8/3") == 2
    for bad in ("1/0", "__import__('os')", "2**99", "a+1", "", "9" * 20 + "*" + "9" * 20):
        assert calculate(bad) is None


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


def test_a_calculator_episode_whose_budget_runs_out_in_tool_output_is_cut():
    """It stopped at the budget (finish length, as a sample cut there): overlong filtering and
    truncated_fraction count it."""
    tok = CharTok()
    agent = CalculatorAgent(AgentConfig(kind="calculator", max_new_tokens=6, max_turns=3), tok)

    def policy(req):
        ids = tok.encode("[3*4]")
        return [{"tokens": np.array(ids, np.int32), "logprobs": np.zeros(len(ids), np.float32),
                 "versions": np.zeros(len(ids), np.int32), "finish": "stop"}]

    (traj,) = _drive(agent.episodes([1] + tok.encode("3*4="), 1)[0], policy)
    assert len(traj["mask"]) == 6 and traj["mask"].tolist() == [1] * 5 + [0]  # "1" of "12"
    assert traj["finish"] == "length"


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


def test_training_samples_at_a_temperature_and_evaluation_greedily():
    """Temperature 0 for training made every sample of a group the same (GRPO advantages all
    0, nothing learned) and PPO's behaviour log-probs not the policy's: it is refused; greedy
    evaluation sets its own temperature and keeps working."""
    import pytest

    from system.errors import ConfigError

    for bad in (0.0, -0.5):
        with pytest.raises(ConfigError, match=rf"^temperature={bad} is not valid for training "
                                              r"rollouts: .*valid: > 0"):
            AgentConfig(temperature=bad)
    for kind in ("single", "calculator"):
        cfg = AgentConfig(kind=kind, temperature=0.7, top_p=0.9)
        agent = CalculatorAgent(cfg, CharTok()) if kind == "calculator" else SingleTurnAgent(cfg)
        greedy, train = next(agent.episodes([1, 2], 1, greedy=True)[0]), \
            next(agent.episodes([1, 2], 1)[0])
        assert (greedy.sampling["temperature"], greedy.sampling["top_p"]) == (0.0, 1.0)
        assert (train.sampling["temperature"], train.sampling["top_p"]) == (0.7, 0.9)


def test_trajectories_carry_the_temperature_their_tokens_were_sampled_at():
    """What the trainer takes its log-probs at: the agent's temperature on every sampled token,
    1 on tool output; greedy (evaluation) episodes and temperature 1 carry none."""
    tok = CharTok()
    turns = iter(["[3*4]", "2</s>"])

    def policy(req):
        text = next(turns)
        ids = tok.encode(text.replace("</s>", "")) + ([2] if text.endswith("</s>") else [])
        return [{"tokens": np.array(ids, np.int32), "logprobs": np.zeros(len(ids), np.float32),
                 "versions": np.zeros(len(ids), np.int32), "finish": "stop"}]

    cfg = AgentConfig(kind="calculator", max_new_tokens=12, temperature=0.7)
    (traj,) = _drive(CalculatorAgent(cfg, tok).episodes([1] + tok.encode("3*4="), 1)[0], policy)
    assert traj["temps"].tolist() == [np.float32(0.7)] * 5 + [1.0, 1.0] + [np.float32(0.7)] * 2
    for temperature, greedy in ((0.7, True), (1.0, False)):
        turns = iter(["5</s>"])
        agent = SingleTurnAgent(AgentConfig(temperature=temperature))
        (traj,) = _drive(agent.episodes([1, 2], 1, greedy=greedy)[0], policy)
        assert "temps" not in traj


def test_each_task_samples_from_seeds_of_its_own():
    """A task's seed comes from the run's seed and the task's number alone (not which worker
    or server runs it); a single-turn group of n samples takes base .. base+n-1 (the server
    adds the sample's index), a calculator's episodes one seed per turn, none shared."""
    base = task_seed(1, 7)
    assert base == task_seed(1, 7) and 0 <= base < 1 << 62
    assert len({task_seed(s, q) for s in (1, 2) for q in range(1000)}) == 2000
    (ep,) = SingleTurnAgent(AgentConfig()).episodes([1, 2], 4, seed=base)
    assert next(ep).sampling["seed"] == base
    assert "seed" not in next(SingleTurnAgent(AgentConfig()).episodes([1, 2], 4)[0]).sampling
    greedy = next(SingleTurnAgent(AgentConfig()).episodes([1, 2], 1, greedy=True, seed=base)[0])
    assert "seed" not in greedy.sampling  # (greedy: nothing drawn)
    seeds = {request_seed(base, e, t, 4) for e in range(8) for t in range(4)}
    assert seeds == set(range(base, base + 32)) and request_seed(None, 1, 2, 4) is None
    agent = CalculatorAgent(AgentConfig(kind="calculator", max_turns=3), CharTok())
    firsts = [next(ep).sampling["seed"] for ep in agent.episodes([1, 2], 3, seed=base)]
    assert firsts == [base, base + 3, base + 6]
