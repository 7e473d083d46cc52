"""The evaluation's plan and figures (pure): greedy by default; k seeded samples a prompt at
the evaluation's temperature, one request of k (single turn) or k episodes (calculator), each
weighing on its server as the samples it asks for; avg@k, pass@k and the answers' digest."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from experiments.rl.agents import make_agent
from experiments.rl.evaluate import eval_episodes, eval_seed, scored
from experiments.rl.tasks import Prompt
from tests.helpers import CharTok

PROMPTS = [(Prompt(id=i, prompt=f"{i}+1=", answer=i + 1), [1, 3 + i]) for i in range(3)]


def _rl(overrides: list[str]):
    from system.launch import build_config

    return build_config("arith-tiny", "t", overrides).rl


def _first_requests(planned) -> list:
    return [next(e.episode) for e in planned]


@pytest.mark.parametrize("kind", ["single", "calculator"])
def test_sampled_evaluation_asks_k_seeded_samples_at_its_temperature(kind):
    rl = _rl([f"rl.agent.kind={kind}", "rl.agent.temperature=1.3", "rl.agent.top_p=0.9",
              "rl.eval_samples=4", "rl.eval_temperature=0.6"])
    planned = eval_episodes(rl, make_agent(rl.agent, CharTok()), CharTok(), PROMPTS)
    requests = _first_requests(planned)
    per_prompt = 1 if kind == "single" else 4
    assert [e.prompt for e in planned] == [i for i in range(3) for _ in range(per_prompt)]
    assert {e.weight for e in planned} == {4 // per_prompt}  # the samples it asks for
    assert sum(r.n for r in requests) == 12
    for e, r in zip(planned, requests):
        assert (r.sampling["temperature"], r.sampling["top_p"]) == (0.6, 1.0)
        assert r.prompt == PROMPTS[e.prompt][1]
    seeds = [r.sampling["seed"] for r in requests]
    assert seeds[0] == eval_seed(rl.seed, 0) and len(set(seeds)) == len(seeds)
    again = [r.sampling["seed"] for r in _first_requests(
        eval_episodes(rl, make_agent(rl.agent, CharTok()), CharTok(), PROMPTS))]
    assert again == seeds  # the same at every evaluation


def test_greedy_evaluation_is_one_unseeded_greedy_answer_a_prompt():
    rl = _rl(["rl.agent.kind=calculator", "rl.agent.temperature=1.3"])
    planned = eval_episodes(rl, make_agent(rl.agent, CharTok()), CharTok(), PROMPTS)
    requests = _first_requests(planned)
    assert [e.prompt for e in planned] == [0, 1, 2] and {e.weight for e in planned} == {1}
    assert all(r.sampling["temperature"] == 0.0 and "seed" not in r.sampling
               for r in requests)


def _answer(tokens: list[int], reward: float) -> dict:
    return {"tokens": np.asarray(tokens, np.int32), "reward": reward}


def test_avg_and_pass_at_k_and_a_digest_of_every_answer():
    answers = [[_answer([1, 2], 1.0), _answer([1, 3], 0.0)],
               [_answer([2, 2], 0.0), _answer([2, 3], 0.0)]]
    ev = scored(answers, hashlib.sha256(), 2)
    assert ev.accuracy == 0.25 and ev.pass_at_k == 0.5
    assert ev.figures() == {"eval_accuracy": 0.25, "eval_digest": ev.digest,
                            "eval_pass_at_k": 0.5}
    assert scored(answers[::-1], hashlib.sha256(), 2).digest != ev.digest
    one = scored([[a[0]] for a in answers], hashlib.sha256(), 1)
    assert one.pass_at_k is None and "eval_pass_at_k" not in one.figures()
    # a greedy evaluation's digest is what it was before k existed: the answers in order
    want = hashlib.sha256()
    for a in answers:
        want.update(a[0]["tokens"].astype("<i8").tobytes() + b"|")
    assert one.digest == want.hexdigest()[:16]
