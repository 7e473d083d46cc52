"""Recorded agent sessions: bounds, fetch-and-drop, unknown and closed sessions, expiry."""
from __future__ import annotations

import pytest

from system.errors import ConfigError
from workers.engines.openai_http import _session_route
from workers.engines.http_server import HttpError
from workers.engines.openai_sessions import SessionLimits, SessionRefused, SessionStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _turn(res, index, prompt, tokens, version=3):
    res.record(index, prompt, tokens, [-0.5] * len(tokens), [version] * len(tokens), "stop",
               0.7)


def test_turns_come_back_in_request_order_and_are_dropped():
    store = SessionStore()
    a = store.admit("s1", 3, 1, 4)
    b = store.admit("s1", 5, 2, 4)
    _turn(b, 1, [1, 2, 3, 4, 5], [9])  # finishes before the earlier request
    _turn(a, 0, [1, 2, 3], [7, 8])
    _turn(b, 0, [1, 2, 3, 4, 5], [6, 6])
    a.release(), b.release()
    (rec,) = store.take(["s1"])
    assert rec["found"] and rec["pending"] == 0
    assert [t["tokens"].tolist() for t in rec["turns"]] == [[7, 8], [6, 6], [9]]
    assert rec["turns"][0]["prompt"].tolist() == [1, 2, 3]
    assert rec["turns"][0]["versions"].tolist() == [3, 3]
    assert rec["turns"][0]["logprobs"].dtype.kind == "f"
    assert rec["turns"][0]["temperature"] == 0.7  # (what the trainer takes its log-probs at)
    assert store.held() == (0, 0)  # dropped, every token given back
    (again,) = store.take(["s1"])
    assert not again["found"] and again["turns"] == []


def test_an_unknown_session_is_not_found_and_a_taken_one_stays_closed():
    store = SessionStore()
    (rec,) = store.take(["never"])
    assert rec == {"session": "never", "found": False, "turns": [], "pending": 0}
    with pytest.raises(SessionRefused) as e:
        store.admit("never", 3, 1, 4)
    assert e.value.status == 400 and "taken" in str(e.value)


def test_a_choice_that_finishes_after_the_take_is_not_recorded():
    store = SessionStore()
    res = store.admit("s", 3, 1, 4)
    (rec,) = store.take(["s"])
    assert rec["found"] and rec["pending"] == 1 and rec["turns"] == []
    _turn(res, 0, [1, 2, 3], [4])
    assert store.stats["late"] == 1 and store.held() == (0, 0)


def test_per_session_bounds_refuse_before_anything_is_generated():
    store = SessionStore(SessionLimits(max_turns=2, max_session_tokens=20))
    res = store.admit("s", 4, 1, 4)
    with pytest.raises(SessionRefused) as e:
        store.admit("s", 4, 2, 4)  # 3 choices > 2
    assert e.value.status == 400 and "session_max_turns" in str(e.value)
    with pytest.raises(SessionRefused) as e:
        store.admit("s", 10, 1, 5)  # 8 + 15 tokens > 20
    assert "session_max_tokens" in str(e.value)
    _turn(res, 0, [1, 2, 3, 4], [5])  # used 5 of its 8: 3 come back
    store.admit("s", 10, 1, 5)  # 5 + 15 = 20 fits now
    assert store.stats["refused"] == 2


def test_store_bounds_answer_429_and_release_gives_room_back():
    store = SessionStore(SessionLimits(max_sessions=2, max_total_tokens=30))
    a = store.admit("a", 5, 1, 5)
    store.admit("b", 5, 1, 5)
    with pytest.raises(SessionRefused) as e:
        store.admit("c", 1, 1, 1)
    assert e.value.status == 429
    with pytest.raises(SessionRefused) as e:
        store.admit("a", 5, 1, 6)  # 20 + 11 > 30 tokens over all sessions
    assert e.value.status == 429
    a.release()  # its choice never finished: nothing recorded, its tokens come back
    assert store.held() == (2, 10)
    store.take(["a"])
    store.admit("c", 1, 1, 1)


def test_untouched_sessions_expire():
    clock = Clock()
    store = SessionStore(SessionLimits(max_sessions=1, ttl=10), clock=clock)
    res = store.admit("old", 2, 1, 2)
    _turn(res, 0, [1, 2], [3])
    clock.t = 11
    store.admit("new", 2, 1, 2)  # the old one expired and made room
    assert store.stats["expired"] == 1
    assert store.take(["old"])[0]["found"] is False


def test_session_ids_and_routes():
    assert _session_route("/v1/completions") == ("/v1/completions", None)
    assert _session_route("/sessions/ab-1.x_2/v1/chat/completions") == (
        "/v1/chat/completions", "ab-1.x_2")
    for bad in ("/sessions//v1/completions", "/sessions/a%20b/v1/completions",
                "/sessions/" + "x" * 65 + "/v1/completions"):
        with pytest.raises(HttpError) as e:
            _session_route(bad)
        assert e.value.code == 400
    with pytest.raises(SessionRefused):
        SessionStore().admit("a b", 1, 1, 1)


def test_limits_are_validated_naming_the_key():
    from workers.generation import GenerationServerConfig

    with pytest.raises(ConfigError, match="^session_max_turns must be >= 1"):
        GenerationServerConfig(session_max_turns=0)
    with pytest.raises(ConfigError, match="^session_ttl must be > 0"):
        GenerationServerConfig(session_ttl=0)
