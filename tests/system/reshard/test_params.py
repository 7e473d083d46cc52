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
