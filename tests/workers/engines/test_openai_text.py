"""Incremental text of a sample and the reading of request bodies, without an engine: stop
strings held back and cut, incomplete UTF-8 held back, and the fields refused with their names."""
from __future__ import annotations

import pytest

from system.errors import ConfigError
from workers.engines.openai_chat import chat_messages, chat_tools, takes_tools
from workers.engines.openai_request import chat_request, completion_request
from workers.engines.openai_text import SampleText

WORDS = ["Hel", "lo", " wor", "ld", "!", " STOP", " here", "\xe2", "\x82\xac"]


def _decode(ids: list[int]) -> str:
    """Word pieces; ids 7 and 8 are the two halves of a UTF-8 euro sign (bytes)."""
    data = b"".join(WORDS[i].encode("latin-1") for i in ids)
    return data.decode("utf-8", errors="replace")


def _run(stop: tuple[str, ...], ids: list[int], finish: str = "length") -> tuple[list[str], str]:
    text = SampleText(_decode, stop)
    pieces = []
    for k, t in enumerate(ids):
        piece = text.add((t,), finish if k == len(ids) - 1 else None)
        pieces.append(piece.text)
        if piece.finish is not None:
            return pieces, piece.finish
    raise AssertionError("never finished")


def test_without_stop_strings_text_goes_out_as_it_comes():
    pieces, finish = _run((), [0, 1, 2, 3])
    assert pieces == ["Hel", "lo", " wor", "ld"] and finish == "length"


def test_a_stop_string_is_held_back_then_cut_and_never_sent():
    pieces, finish = _run((" STOP",), [0, 1, 2, 3, 5, 6])
    assert "".join(pieces) == "Hello world" and finish == "stop"
    assert pieces[:3] == ["", "H", "ello"]  # the last 4 characters wait (a " STOP" to come?)
    pieces, finish = _run(("lo w",), [0, 1, 2, 3])
    assert "".join(pieces) == "Hel" and finish == "stop"


def test_a_stop_string_across_tokens_and_the_earliest_of_several():
    pieces, finish = _run(("ld!", "o w"), [0, 1, 2, 3, 4])
    assert "".join(pieces) == "Hell" and finish == "stop"


def test_an_incomplete_utf8_sequence_is_held_back():
    text = SampleText(_decode, ())
    assert text.add((0,), None).text == "Hel"
    assert text.add((7,), None).text == ""  # half a euro sign decodes to U+FFFD: it waits
    assert text.add((8,), None).text == "\u20ac"
    assert text.text == "Hel\u20ac"


def test_the_last_delta_sends_what_was_held():
    pieces, finish = _run(("zzzzzz",), [0, 1, 2])
    assert "".join(pieces) == "Hello wor" and finish == "length"


BAD_BODIES = [
    ({"stream": 1}, "stream must be true or false"),
    ({"stop": ["a"] * 5}, "stop: at most 4"),
    ({"stop": [1]}, "stop must be a string or a list of strings"),
    ({"seed": True}, "seed must be an integer"),
    ({"seed": 1 << 63}, "seed must be < 2**63"),
    ({"n": 9}, "n must be <= 8"),
    ({"best_of": 3}, "best_of is not supported"),
    ({"frequency_penalty": 0.5}, "frequency_penalty is not supported"),
    ({"stream": True, "stream_options": []}, "stream_options must be an object"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "include_usage must be true or false"),
]


@pytest.mark.parametrize("body,names", BAD_BODIES)
def test_bad_fields_are_named(body, names):
    with pytest.raises(ConfigError, match=names.replace("*", r"\*")):
        completion_request({"prompt": "x", **body}, max_n=8)


def test_good_bodies():
    req = completion_request({"prompt": "x", "stop": "ab", "seed": 5, "logprobs": 3,
                              "stream": True, "stream_options": {"include_usage": True}}, 8)
    assert req.stop == ("ab",) and req.sampling.seed == 5 and req.top_logprobs == 3
    assert req.stream and req.include_usage and req.logprobs
    req = chat_request({"max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2}, 8, 99)
    assert req.sampling.max_tokens == 7 and req.sampling.top_logprobs == 2
    assert chat_request({}, 8, 99).sampling.max_tokens == 99  # what the context leaves


def test_messages_and_tools():
    msgs = chat_messages({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                       "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "r", "tool_call_id": "1"}]})
    assert msgs[0]["content"] == "ab" and msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "f"
    assert msgs[2]["tool_call_id"] == "1"
    with pytest.raises(ConfigError, match=r"messages\[0\].tool_calls"):
        chat_messages({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})
    tool = {"type": "function", "function": {"name": "f"}}
    assert chat_tools({"tools": [tool]}) == [tool]
    assert chat_tools({"tools": [tool], "tool_choice": "none"}) is None
    with pytest.raises(ConfigError, match="tools must be a list"):
        chat_tools({"tools": []})

    class Tok:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not takes_tools(Tok())
    Tok.chat_template = "{% if tools %}{{ tools }}{% endif %}"
    assert takes_tools(Tok())
