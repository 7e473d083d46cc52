"""Resharding: bit-exact execution of plans over gloo (the executor, driven by the check)."""
from __future__ import annotations

import pytest
import torch

from system.reshard.params import ModelShape, qwen2_specs
from system.reshard.check import MODELS, run_check
from system.reshard.plan import plan_reshard
from system.reshard.layout import GenLayout, TrainLayout

TINY = MODELS["tiny"]
SRC = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2)]


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("dst_tp", [1, 2])
@pytest.mark.parametrize("replicas", [1, 2])
def test_reshard_bit_exact_over_gloo(src, dst_tp, replicas):
    bad, fig = run_check(TrainLayout(*src), GenLayout(dst_tp, replicas), TINY,
                         bucket_bytes=4096, threads=True, timeout=120)
    assert bad == []
    assert fig["buckets"] > 1


@pytest.mark.parametrize("src, dst", [((2, 2, 1), (2, 2)), ((1, 2, 2), (1, 2)),
                                      ((2, 1, 2), (2, 1))])
def test_regions_sent_and_received_in_place(src, dst):
    """Large regions travel alone, from the sender's shard into the receiver's parameter
    (row-split ones, not contiguous, are staged)."""
    bad, _ = run_check(TrainLayout(*src), GenLayout(*dst), TINY, bucket_bytes=4096,
                       direct_bytes=256, threads=True)
    assert bad == []
    plan = plan_reshard(TrainLayout(*src), GenLayout(*dst), qwen2_specs(TINY), 2,
                        bucket_bytes=4096, direct_bytes=256)
    assert sum(len(b.transfers) == 1 for b in plan.buckets) > len(plan.buckets) // 2


@pytest.mark.parametrize("lanes", [1, 3])
def test_runs_land_in_place(lanes):
    """Regions that fill one vLLM parameter back to back (q, k, v into ``qkv_proj``) travel as
    one broadcast, received straight into that parameter; only small leftovers (o_proj shards
    under direct_bytes, biases, norms) are unpacked. Any number of lanes gives the same bytes."""
    src, dst = TrainLayout(1, 2, 1), GenLayout(2, 2)
    plan = plan_reshard(src, dst, qwen2_specs(TINY), TINY.num_layers, bucket_bytes=64 << 10,
                        direct_bytes=12 << 10)
    runs = [b for b in plan.buckets
            if [t.param.rsplit(".", 2)[-2] for t in b.transfers] == ["q_proj", "k_proj", "v_proj"]]
    assert len(runs) == TINY.num_layers * dst.tp
    bad, fig = run_check(src, dst, TINY, bucket_bytes=64 << 10, direct_bytes=12 << 10,
                         lanes=lanes, threads=True)
    assert bad == []
    # q, k, v alone would add 16 KiB per layer to the unpacked bytes (0.29 of the total)
    assert 0 < fig["max_bytes_unpacked"] < 0.15 * fig["bytes_per_dst_rank"]


def test_bf16_and_uneven_pipeline():
    shape = ModelShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                       num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    bad, _ = run_check(TrainLayout(1, 2, 2), GenLayout(2, 2), shape, dtype=torch.bfloat16,
                       threads=True, bucket_bytes=1024)
    assert bad == []


@pytest.mark.parametrize("src", [TrainLayout(dp=2, fsdp=True), TrainLayout(dp=5, fsdp=True),
                                 TrainLayout(dp=2, tp=2, fsdp=True)])
@pytest.mark.parametrize("dst", [GenLayout(1, 1), GenLayout(2, 2)])
def test_fsdp_sources_bit_exact_with_uneven_and_empty_chunks(src, dst):
    """Each training rank holds only its FSDP2 dim-0 chunks; at dp=5 most tensors split
    unevenly and the 4-row k/v biases and q/k norms leave rank 4 an empty chunk."""
    shape = ModelShape(vocab_size=22, hidden_size=12, intermediate_size=6, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=True, qk_norm=True)
    bad, _ = run_check(src, dst, shape, bucket_bytes=256, direct_bytes=64, threads=True)
    assert bad == []
