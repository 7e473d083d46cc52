"""The HF <-> megatron-core mapping: layout of the shards, bit-exact roundtrips, refusals."""
from __future__ import annotations

import dataclasses
import itertools
import zlib

import pytest
import torch

from system.reshard.layout import LayoutError
from system.reshard.megatron import (VALUE_HEAD, check_megatron, hf_shapes, hf_to_megatron_shard,
                                     megatron_local_params, megatron_shards_to_hf, padded_vocab)
from system.reshard.params import ModelShape, qwen2_specs

# 8 heads in 4 query groups (GQA), 2 layers; 4 layers for pp=2 with 2 layers per stage
GQA = ModelShape(vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=4, qkv_bias=True)


def random_hf(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for s in qwen2_specs(shape):
        g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(s.name.encode()))
        out[s.name] = torch.randn(s.shape, generator=g)
    return out


SHAPES = {
    "gqa_bias": GQA,
    "gqa_tied_nobias": dataclasses.replace(GQA, tie_word_embeddings=True, qkv_bias=False),
    "mha_tied": dataclasses.replace(GQA, num_kv_heads=8, tie_word_embeddings=True),
    "mqa_like": dataclasses.replace(GQA, num_kv_heads=4, num_heads=16, head_dim=2),
    "qwen3": dataclasses.replace(GQA, tie_word_embeddings=True, qkv_bias=False, qk_norm=True),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tp,pp", list(itertools.product((1, 2, 4), (1, 2))))
@pytest.mark.parametrize("divisible_by", (128, 1))
def test_roundtrip_is_bit_exact(name: str, tp: int, pp: int, divisible_by: int):
    shape = SHAPES[name]
    hf = random_hf(shape)
    shards = {(t, p): hf_to_megatron_shard(hf, shape, tp, t, pp, p, divisible_by)
              for t in range(tp) for p in range(pp)}
    back = megatron_shards_to_hf(shards, shape, tp, pp, divisible_by)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


@pytest.mark.parametrize("name", ["gqa_bias", "gqa_tied_nobias"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1)])
def test_a_critics_value_head_roundtrips_on_tp_rank_0(name: str, tp: int, pp: int):
    """A critic (HF ``*ForTokenClassification``, one label): no LM head (tied or not); its
    ``score`` is the last stage's output layer on tp rank 0, the other ranks' columns zero."""
    shape = SHAPES[name]
    hf = {k: torch.randn(s) for k, s in hf_shapes(shape, "value").items()}
    assert "lm_head.weight" not in hf and hf[VALUE_HEAD[0]].shape == (1, 32)
    shards = {(t, p): hf_to_megatron_shard(hf, shape, tp, t, pp, p, head="value")
              for t in range(tp) for p in range(pp)}
    for t in range(tp):
        last = shards[(t, pp - 1)]
        assert last["output_layer.weight"].shape == (1, 32)
        assert last["output_layer.bias"].shape == (1,)
        if t == 0:
            assert torch.equal(last["output_layer.weight"], hf[VALUE_HEAD[0]])
            assert torch.equal(last["output_layer.bias"], hf[VALUE_HEAD[1]])
        else:
            assert not last["output_layer.weight"].any() and not last["output_layer.bias"].any()
    if pp > 1:
        assert "output_layer.weight" not in shards[(0, 0)]
    back = megatron_shards_to_hf(shards, shape, tp, pp, head="value")
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k
    with pytest.raises(LayoutError, match="head='reward' is not one of lm, value"):
        megatron_local_params(shape, tp, 0, pp, 0, head="reward")


def test_fused_qkv_and_fc1_layout():
    shape = GQA  # 2 q heads per group, head_dim 4
    hf = random_hf(shape)
    s = hf_to_megatron_shard(hf, shape, 2, 1, 1, 0)
    qkv = s["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert qkv.shape == (2 * (2 + 2) * 4, 32)  # rank 1 holds query groups 2 and 3
    assert torch.equal(qkv[0:8], q[16:24]) and torch.equal(qkv[8:12], k[8:12])
    assert torch.equal(qkv[12:16], v[8:12]) and torch.equal(qkv[16:24], q[24:32])
    fc1 = s["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert torch.equal(s["decoder.layers.0.mlp.linear_fc2.weight"],
                       hf["model.layers.0.mlp.down_proj.weight"].chunk(2, dim=1)[1])
    # the vocabulary (100) is padded to 256 (128 x tp): rank 1 holds only padding
    emb = s["embedding.word_embeddings.weight"]
    assert emb.shape == (128, 32) and not emb.any()
    assert padded_vocab(100, 2) == 256 and padded_vocab(256, 2) == 256


def test_stages_restart_layer_indices_and_hold_their_ends():
    tied = dataclasses.replace(GQA, tie_word_embeddings=True)
    first = {p.name for p in megatron_local_params(tied, 1, 0, 2, 0)}
    last = {p.name: p for p in megatron_local_params(tied, 1, 0, 2, 1)}
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.layers.1.mlp.linear_fc2.weight" in first
    assert "decoder.layers.2.mlp.linear_fc2.weight" not in first | last.keys()
    assert last["decoder.layers.0.input_layernorm.weight"].pieces[0].source == \
        "model.layers.2.input_layernorm.weight"
    # tied at pp=2: the last stage keeps a copy of the embedding as output_layer
    assert last["output_layer.weight"].pieces[0].source == "model.embed_tokens.weight"
    assert "output_layer.weight" not in {p.name for p in megatron_local_params(tied, 1, 0, 1, 0)}


def test_disagreeing_copies_are_caught():
    hf = random_hf(GQA)
    shards = {(t, 0): hf_to_megatron_shard(hf, GQA, 2, t, 1, 0) for t in range(2)}
    shards[(1, 0)]["decoder.final_layernorm.weight"][0] += 1
    with pytest.raises(ValueError, match="disagrees"):
        megatron_shards_to_hf(shards, GQA, 2, 1)


@pytest.mark.parametrize("tp,pp,words", [(8, 1, "query groups"), (3, 1, "query groups"),
                                         (1, 3, "layers"), (4, 1, None)])
def test_refusals_name_the_cause(tp: int, pp: int, words: str | None):
    if words is None:
        check_megatron(GQA, tp, pp)
        return
    with pytest.raises(LayoutError, match=words):
        check_megatron(GQA, tp, pp)
