"""Scoring episodes."""
from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np

from experiments.rl.rewards import first_int_reward
from tests.helpers import CharTok


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


def test_a_reward_that_raises_or_returns_no_finite_number_is_a_config_error():
    import pytest

    from experiments.rl.episodes import score
    from system.errors import ConfigError

    tok = CharTok()
    prompt = [1] + tok.encode("1+1=")

    def traj():
        return {"tokens": np.array(prompt + tok.encode("2"), np.int32),
                "prompt_len": len(prompt), "mask": np.ones(1, np.int8)}

    for value, shown in ((float("nan"), "'nan' (float)"), (float("inf"), "'inf' (float)"),
                         ("1", "'1' (str)"), (None, "'None' (NoneType)"),
                         (10 ** 400, "'1000000000000000000000000000000000000000' (int)"),
                         (1j, "'1j' (complex)")):
        with pytest.raises(ConfigError) as e:
            score([traj()], tok, 2, lambda c, a, v=value: v)
        assert f"returned {shown} on the completion '2' (answer '2'); valid: a finite" \
            in str(e.value)

    def broken(c, a):
        raise KeyError("boom")

    with pytest.raises(ConfigError, match=r"test_episodes\..*broken \(rl.task.reward, or the "
                                          r"task's own\) raised KeyError: 'boom'"):
        score([traj()], tok, 2, broken)

    def verbose(c, a):
        raise ValueError("first line\nsecond line")

    def leaves(c, a):
        import sys
        sys.exit(0)

    # it ended the worker as if its role had finished (exit 0: a master read as completed)
    with pytest.raises(ConfigError, match=r"leaves \(rl.task.reward, or the task's own\) "
                                          r"raised ExitCalled: it called sys.exit\(0\)"):
        score([traj()], tok, 2, leaves)

    with pytest.raises(ConfigError) as e:  # named in one line
        score([traj()], tok, 2, verbose)
    assert "raised ValueError: first line on the completion" in str(e.value)
    assert "\n" not in str(e.value)
    for number in (np.float32(0.5), np.int64(1), Fraction(1, 2), Decimal("0.5")):
        t = traj()
        score([t], tok, 2, lambda c, a, n=number: n)  # numbers of every kind are numbers
        assert t["reward"] == float(number) and isinstance(t["reward"], float)
    t = traj()
    t = traj()
    score([t], tok, 2, lambda c, a: c == str(a))  # a comparison's bool is 1 or 0
    assert t["reward"] == 1.0 and isinstance(t["reward"], float)
    score([t], tok, 2, lambda c, a: np.isclose(float(c), 3.0))  # numpy's bool too
    assert t["reward"] == 0.0 and isinstance(t["reward"], float)


def test_a_reward_that_fails_transiently_is_asked_again_then_fails_the_worker():
    import pytest

    from experiments.rl.episodes import RewardUnavailable, score
    from system.errors import ConfigError

    tok = CharTok()
    prompt = [1] + tok.encode("1+1=")
    traj = {"tokens": np.array(prompt + tok.encode("2"), np.int32),
            "prompt_len": len(prompt), "mask": np.ones(1, np.int8)}
    calls = []

    def flaky(c, a, failures=2, error=ConnectionRefusedError):
        calls.append(c)
        if len(calls) <= failures:
            raise error(111, "Connection refused")
        return 1.0

    score([traj], tok, 2, flaky, delays=(0.0, 0.0, 0.0))
    assert traj["reward"] == 1.0 and len(calls) == 3
    calls.clear()
    with pytest.raises(RewardUnavailable, match=r"lambda> .* raised ConnectionRefusedError: "
                                                r".*Connection refused.*, 3 times in 0s"):
        score([traj], tok, 2, lambda c, a: flaky(c, a, failures=9), delays=(0.0, 0.0))
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RewardUnavailable):  # a time-out is transient too
        score([traj], tok, 2, lambda c, a: flaky(c, a, 9, TimeoutError), delays=(0.0,))
    calls.clear()
    with pytest.raises(ConfigError, match="raised FileNotFoundError"):  # will be so again
        score([traj], tok, 2, lambda c, a: flaky(c, a, 9, FileNotFoundError), delays=(0.0,))
    assert len(calls) == 1


def test_which_reward_errors_are_transient():
    import httpx
    import openai
    import requests

    from experiments.rl.episodes import transient

    assert transient(ConnectionRefusedError(111, "refused")) and transient(TimeoutError())
    assert transient(requests.ConnectionError("down"))  # an OSError
    assert transient(httpx.ConnectError("down"))  # not an OSError: by its base's name
    assert transient(openai.APIConnectionError(request=httpx.Request("POST", "http://v/")))
    assert transient(openai.APITimeoutError(request=httpx.Request("POST", "http://v/")))
    try:  # a library's own error raised from a connection error
        try:
            raise ConnectionResetError(104, "reset")
        except OSError as inner:
            raise RuntimeError("verifier call failed") from inner
    except RuntimeError as outer:
        assert transient(outer)
    assert not transient(FileNotFoundError(2, "no such file"))
    assert not transient(ValueError("bad answer")) and not transient(KeyError("x"))
    refused, failed = requests.Response(), requests.Response()
    refused.status_code, failed.status_code = 404, 503
    assert not transient(requests.HTTPError("404", response=refused))  # asking again: 404
    assert transient(requests.HTTPError("503", response=failed))


def _generation_server(answer_after: float | None):
    """A real RPC server whose ``generate`` answers one sample after ``answer_after`` seconds
    (None: never), and a :class:`GenerationClient` of it; returns (client, close)."""
    import threading
    from concurrent.futures import Future

    from system.rpc import RpcClient, RpcServer
    from system.wire import Codec, new_secret
    from workers.generation import GenerationClient

    codec = Codec(new_secret())
    asked = []

    def generate(prompt, n, sampling) -> Future:
        asked.append(prompt)
        fut: Future = Future()
        sample = {"tokens": np.array([7], np.int32), "logprobs": np.array([-0.5], np.float32),
                  "versions": np.array([0], np.int32), "finish": "stop"}
        if answer_after is not None:
            threading.Timer(answer_after, fut.set_result, args=([sample] * n,)).start()
        return fut

    server = RpcServer(codec, "127.0.0.1", {"generate": generate})
    stop = threading.Event()
    thread = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
    thread.start()
    client = GenerationClient(RpcClient(codec, server.address, timeout=30), "generation/0")

    def close() -> None:
        client.close()
        stop.set()
        thread.join(5)
        server.close()
    close.asked = asked  # type: ignore[attr-defined]
    return client, close


def _episodes():
    from experiments.rl.agents import SingleTurnAgent
    from experiments.rl.config import AgentConfig

    return [(ep, 0) for ep in SingleTurnAgent(AgentConfig()).episodes([1, 2, 3], 2)]


def test_a_rollout_worker_stopped_by_a_signal_cuts_its_waiting_episodes_short():
    """A rollout worker stopped by a signal (its job ends soon) abandons the generate calls it
    still waits on once its ``stop_by`` has passed (CallAbandoned: the tasks go back to the
    master as failed groups), instead of waiting up to ``rl.call_timeout`` (900 s) while Slurm
    kills the job; a call that answers is not cut."""
    import time

    import pytest

    from experiments.rl.episodes import run_episodes
    from system.errors import CallAbandoned

    client, close = _generation_server(None)
    try:
        t0 = time.monotonic()
        with pytest.raises(CallAbandoned, match="cut short"):
            run_episodes(_episodes(), {0: client}, 60.0, lambda s: True,
                         lambda: time.monotonic() - t0 > 0.3)
        assert time.monotonic() - t0 < 3.0
    finally:
        close()
    client, close = _generation_server(0.3)
    try:  # (no cut, no alive: the reply across several checks)
        (trajs,) = run_episodes(_episodes(), {0: client}, 60.0)
        assert len(trajs) == 2 and list(trajs[0]["tokens"]) == [1, 2, 3, 7]
    finally:
        close()
    client, close = _generation_server(0.0)
    try:  # cut already: not one more round submitted
        with pytest.raises(CallAbandoned, match="before the next round"):
            run_episodes(_episodes(), {0: client}, 60.0, cut=lambda: True)
        assert close.asked == []
    finally:
        close()
