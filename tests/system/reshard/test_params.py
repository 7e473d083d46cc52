"""Resharding parameters: Qwen2 specs, their splits, pipeline stages and vLLM's fused params."""
from __future__ import annotations

from system.reshard.params import Split, qwen2_specs, stage_of, tp_box, vllm_local_params
from system.reshard.check import MODELS

TINY = MODELS["tiny"]


def test_specs_and_stages():
    specs = qwen2_specs(TINY)
    names = {s.name: s for s in specs}
    assert names["model.layers.0.self_attn.o_proj.weight"].split == Split.ROW
    assert names["model.layers.1.mlp.down_proj.weight"].split == Split.ROW
    assert names["model.embed_tokens.weight"].split == Split.VOCAB
    assert stage_of(names["model.embed_tokens.weight"], 2, 2) == 0
    assert stage_of(names["lm_head.weight"], 2, 2) == 1
    assert stage_of(names["model.layers.1.mlp.up_proj.weight"], 2, 2) == 1
    k = names["model.layers.0.self_attn.k_proj.weight"]  # 2 kv heads of 16
    assert [tp_box(k, 4, r)[0] for r in range(4)] == [(0, 16), (0, 16), (16, 32), (16, 32)]
    qkv = {p.name: p for p in vllm_local_params(specs, 2, 1)}[
        "model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (32 + 16 + 16, 64)
    assert [pc.source.split(".")[-2] for pc in qkv.pieces] == ["q_proj", "k_proj", "v_proj"]


def test_qwen3_specs_have_qk_norms_and_unmapped_weights_are_refused():
    import pytest
    from transformers import Qwen3Config

    from system.reshard.params import ModelShape, UnmappedWeightError, check_mapped

    shape = ModelShape.from_hf(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=16))
    assert shape.qk_norm and not shape.qkv_bias
    specs = {s.name: s for s in qwen2_specs(shape)}
    assert specs["model.layers.1.self_attn.q_norm.weight"].shape == (16,)
    assert specs["model.layers.1.self_attn.k_norm.weight"].split == Split.REPLICATED
    assert "model.layers.0.self_attn.q_proj.bias" not in specs
    qwen2 = qwen2_specs(TINY)
    names = [s.name for s in qwen2]
    check_mapped(qwen2, names, "model m")
    with pytest.raises(UnmappedWeightError, match=r"^model m has weight "
                                                  r"'model.layers.0.self_attn.q_norm.weight' that"):
        check_mapped(qwen2, names + ["model.layers.0.self_attn.q_norm.weight"], "model m")
    with pytest.raises(UnmappedWeightError, match="lacks weight 'model.norm.weight'"):
        check_mapped(qwen2, [n for n in names if n != "model.norm.weight"], "model m")
