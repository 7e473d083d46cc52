"""Agents written against the OpenAI API: sessions into trajectories, group checks, config."""
from __future__ import annotations

import numpy as np
import pytest

from experiments.rl.agents import AgentConfig
from experiments.rl.openai_agent import Session, group_trajectories, load_function
from experiments.rl.sessions import session_trajectories
from system.errors import ConfigError
from tests.helpers import CharTok
from workers.schema_check import group_message_problem, trajectory_problem

TOK = CharTok()


def _turn(prompt: str, completion: str, version: int, logprob: float = -0.25,
          finish: str = "stop", temperature: float = 1.0) -> dict:
    ids = TOK.encode(completion)
    return {"prompt": np.asarray(TOK.encode(prompt), np.int32),
            "tokens": np.asarray(ids, np.int32),
            "logprobs": np.full(len(ids), logprob, np.float32),
            "versions": np.full(len(ids), version, np.int32), "finish": finish,
            "temperature": temperature}


def test_two_turns_with_a_tool_output_between_make_one_trajectory():
    turns = [_turn("3*4=", "[3*4]", 5, -0.5),            # the model calls the tool
             _turn("3*4=[3*4]12", "2", 6, -0.125)]        # tool output "12", then the answer
    (t,) = session_trajectories(turns, 0.75, 2)
    assert t["tokens"].tolist() == TOK.encode("3*4=[3*4]122")
    assert t["prompt_len"] == 4
    assert t["mask"].tolist() == [1] * 5 + [0, 0] + [1]
    assert t["logprobs"].tolist() == [-0.5] * 5 + [0.0, 0.0] + [-0.125]
    assert t["versions"].tolist() == [5] * 5 + [-1, -1] + [6]
    assert t["reward"] == 0.75 and t["session"] == 2 and t["finish"] == "stop"
    assert trajectory_problem(t) is None


def test_each_turns_temperature_goes_with_its_tokens_and_tool_output_is_at_1():
    turns = [_turn("3*4=", "[3*4]", 5, temperature=0.7),
             _turn("3*4=[3*4]12", "2", 6, temperature=1.2)]
    (t,) = session_trajectories(turns, 0.75, 2)
    assert t["temps"].tolist() == pytest.approx([0.7] * 5 + [1.0, 1.0] + [1.2])
    assert trajectory_problem(t) is None
    (plain,) = session_trajectories([_turn("1+1=", "2", 0)], 1.0, 0)
    assert "temps" not in plain  # every token at 1: nothing to carry
    for bad in (np.full(2, 0.7, np.float32), np.array([0.7, 0.0, 1.0], np.float32),
                np.array([0.7, np.nan, 1.0], np.float32), np.array([1, 1, 1])):
        t = session_trajectories([_turn("1+1=", "2+0", 0)], 1.0, 0)[0]
        t["temps"] = bad
        assert "temps" in trajectory_problem(t)


def test_a_prompt_that_does_not_extend_the_last_turn_starts_a_new_trajectory():
    turns = [_turn("1+1=", "[1+1]", 0),
             _turn("1+1= [1+1]2", "2", 0),      # history re-rendered (a space): no extension
             _turn("1+1= [1+1]22", "0", 1)]      # extends the second, with nothing between
    a, b = session_trajectories(turns, 1.0, 0)
    assert a["tokens"].tolist() == TOK.encode("1+1=[1+1]") and a["mask"].tolist() == [1] * 5
    assert b["prompt_len"] == len("1+1= [1+1]2")
    assert b["tokens"].tolist() == TOK.encode("1+1= [1+1]220")
    assert b["mask"].tolist() == [1, 1] and b["versions"].tolist() == [0, 1]


def test_choices_of_one_request_are_branches_and_empty_ones_are_left_out():
    turns = [_turn("2+2=", "4", 0), _turn("2+2=", "5", 0), _turn("2+2=", "", 0, finish="length")]
    trajs = session_trajectories(turns, 0.5, 1)
    assert [t["tokens"].tolist()[-1] for t in trajs] == TOK.encode("45")


def _record(sid: str, turns: list[dict]) -> dict:
    return {"session": sid, "found": bool(turns), "turns": turns, "pending": 0}


def test_a_group_is_its_sessions_in_order_with_their_rewards():
    sessions = [Session(0, {"id": 7}), Session(0, {"id": 7})]
    sessions[0].reward, sessions[1].reward = 1.0, 0.0
    records = {sessions[0].id: _record(sessions[0].id, [_turn("1+1=", "2", 3)]),
               sessions[1].id: _record(sessions[1].id, [_turn("1+1=", "[", 3),
                                                        _turn("1+2=", "3", 3)])}
    trajs, error = group_trajectories(sessions, records)
    assert error == "" and [t["session"] for t in trajs] == [0, 1, 1]
    assert [t["reward"] for t in trajs] == [1.0, 0.0, 0.0]
    msg = {"seq": 1, "prompt_id": 7, "worker": 0, "server": 0, "trajs": trajs,
           "failed": False, "error": "", "unservable": False, "agent_error": False}
    assert group_message_problem(msg, group_size=2) is None
    assert "not 0..2" in group_message_problem(msg, group_size=3)
    trajs[2]["reward"] = 1.0
    assert "different rewards" in group_message_problem(msg, group_size=2)


def test_a_failed_or_silent_session_fails_the_group():
    sessions = [Session(0, {"id": 3}), Session(0, {"id": 3})]
    records = {s.id: _record(s.id, [_turn("1+1=", "2", 0)]) for s in sessions}
    sessions[1].error = "rl.agent.function='calculator' raised ValueError: x"
    assert group_trajectories(sessions, records) == ([], sessions[1].error)
    sessions[1].error = ""
    records[sessions[1].id] = _record(sessions[1].id, [])
    trajs, error = group_trajectories(sessions, records)
    assert trajs == [] and "session 1 recorded no completion token" in error


def test_agent_config_is_validated_naming_the_key():
    assert AgentConfig(kind="openai", function="calculator").function == "calculator"
    with pytest.raises(ConfigError, match="^function is empty: kind=openai .*calculator"):
        AgentConfig(kind="openai")
    with pytest.raises(ConfigError, match="^function='os:system' is neither built in nor a "
                                          "plugin .*'slurm_rl.agents'"):
        AgentConfig(kind="openai", function="os:system")
    with pytest.raises(ConfigError, match="^function='calculator' is only read with "
                                          "kind=openai"):
        AgentConfig(kind="single", function="calculator")
    with pytest.raises(ConfigError, match="^kind='agent' is not one of single, calculator, "
                                          "openai"):
        AgentConfig(kind="agent")


def test_the_launcher_refuses_an_openai_agent_without_the_endpoint():
    from system.launch import build_config

    with pytest.raises(ConfigError, match="needs generation.http=true"):
        build_config("arith-tiny", "t", ["rl.agent.kind=openai", "rl.agent.function=calculator",
                                         "generation.http=false"])
    with pytest.raises(ConfigError, match="^rl.agent.function is empty"):
        build_config("arith-tiny", "t", ["rl.agent.kind=openai"])


def test_the_builtin_calculator_function_loads_and_is_async():
    import inspect

    fn = load_function(AgentConfig(kind="openai", function="calculator"))
    assert inspect.iscoroutinefunction(fn)


def test_a_function_that_never_returns_fails_its_session_at_the_deadline():
    """No server is needed: the function never calls one, and the run ends at the deadline
    (``rl.call_timeout``) with the session failed and named, not a rollout worker held."""
    import asyncio
    import time

    from experiments.rl import openai_agent
    from experiments.rl.openai_agent import OpenAIAgent

    async def stuck(client, task):
        await asyncio.sleep(3600)
        return 1.0

    async def quick(client, task):
        return 0.5

    openai_agent.FUNCTIONS.update(stuck=stuck, quick=quick)
    try:
        cfgs = [AgentConfig(kind="openai", function="calculator") for _ in range(2)]
        cfgs[0].function, cfgs[1].function = "stuck", "quick"  # (built in for this test)
        agent, fine = (OpenAIAgent(c, "k" * 43, 0.5) for c in cfgs)
        sessions = [Session(0, {"id": 1}), Session(0, {"id": 2})]
        t0 = time.monotonic()
        agent.run(sessions, {0: "http://127.0.0.1:9"})
        assert time.monotonic() - t0 < 5
        assert all("did not return within" in s.error for s in sessions)
        ok = [Session(0, {"id": 3})]
        fine.run(ok, {0: "http://127.0.0.1:9"})
        assert ok[0].reward == 0.5 and not ok[0].error
    finally:
        del openai_agent.FUNCTIONS["stuck"], openai_agent.FUNCTIONS["quick"]


def test_a_function_that_calls_sys_exit_fails_its_session_naming_it():
    """asyncio raises a task's ``SystemExit`` out of the event loop itself: an agent function
    calling ``sys.exit(0)`` ended the rollout worker as if its role had finished. It fails its
    session, named, as any error of the function does; the other sessions run on."""
    import sys

    from experiments.rl import openai_agent
    from experiments.rl.openai_agent import OpenAIAgent

    async def leaves(client, task):
        if task["id"] == 1:
            sys.exit(0)
        return 0.25

    openai_agent.FUNCTIONS.update(leaves=leaves)
    try:
        cfg = AgentConfig(kind="openai", function="calculator")
        cfg.function = "leaves"  # (built in for this test)
        sessions = [Session(0, {"id": 1}), Session(0, {"id": 2})]
        OpenAIAgent(cfg, "k" * 43, 5.0).run(sessions, {0: "http://127.0.0.1:9"})
        assert sessions[0].error == ("rl.agent.function='leaves' raised ExitCalled: it called "
                                     "sys.exit(0)")
        assert sessions[1].reward == 0.25 and not sessions[1].error
    finally:
        del openai_agent.FUNCTIONS["leaves"]


def test_a_rollout_worker_stopped_by_a_signal_cuts_the_agent_functions_short():
    """As for the single-turn episodes: once the worker's ``stop_by`` has passed, the run ends
    with CallAbandoned (its tasks go back to the master) instead of at ``rl.call_timeout``."""
    import asyncio
    import time

    import pytest

    from experiments.rl import openai_agent
    from experiments.rl.openai_agent import OpenAIAgent
    from system.errors import CallAbandoned

    async def slow(client, task):
        await asyncio.sleep(3600)
        return 1.0

    openai_agent.FUNCTIONS.update(slow=slow)
    try:
        cfg = AgentConfig(kind="openai", function="calculator")
        cfg.function = "slow"  # (built in for this test)
        t0 = time.monotonic()
        with pytest.raises(CallAbandoned, match="cut short"):
            OpenAIAgent(cfg, "k" * 43, 600.0).run([Session(0, {"id": 1})],
                                                  {0: "http://127.0.0.1:9"}, lambda s: True,
                                                  lambda: time.monotonic() - t0 > 0.3)
        assert time.monotonic() - t0 < 5
    finally:
        del openai_agent.FUNCTIONS["slow"]
