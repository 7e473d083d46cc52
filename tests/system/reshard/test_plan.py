"""Resharding: layouts, the pure planner, and bit-exact execution over gloo."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from system.reshard.params import (ModelShape, Split, box_shape, qwen2_specs, stage_of, tp_box,
                                vllm_local_params)
from system.reshard.check import MODELS, run_check
from system.reshard.plan import plan_reshard
from system.reshard.layout import (GenLayout, LayoutError, TrainLayout, parse_gen_layout,
                             parse_train_layout)
from tests.helpers import REPO

TINY = MODELS["tiny"]
SRC = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2)]


def test_layouts():
    t = TrainLayout(dp=2, tp=2, pp=2)
    assert t.world_size == 8
    assert [t.rank(c.dp, c.tp, c.pp) for c in map(t.coord, range(8))] == list(range(8))
    assert t.coord(5) == t.coord(t.rank(dp=0, tp=1, pp=1))
    g = GenLayout(tp=2, replicas=3)
    assert g.coord(5) == (2, 1) and g.rank(2, 1) == 5
    with pytest.raises(LayoutError, match="tp=0"):
        TrainLayout(tp=0)
    assert parse_train_layout("dp=2,tp=2") == TrainLayout(2, 2, 1)
    assert parse_gen_layout("tp=2,replicas=2") == GenLayout(2, 2)
    with pytest.raises(LayoutError, match="ep=2"):
        parse_train_layout("dp=2,ep=2")


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


def _coverage(plan, specs, dst: GenLayout):
    """Every element of every generation rank's parameters is written exactly once."""
    S = plan.num_src
    for r in range(dst.world_size):
        _, tp = dst.coord(r)
        counts = {p.name: torch.zeros(p.shape, dtype=torch.int32)
                  for p in vllm_local_params(specs, dst.tp, tp)}
        for b in plan.for_rank(S + r):
            for t in b.transfers:
                for p in t.placements:
                    if p.rank == S + r:
                        counts[p.param][tuple(slice(a, c) for a, c in p.box)] += 1
        for name, c in counts.items():
            assert torch.all(c == 1), f"rank {S + r} {name} written {c.min()}..{c.max()} times"


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("dst_tp", [1, 2, 4])
def test_plan_covers_each_destination_once(src, dst_tp):
    specs = qwen2_specs(TINY)
    src, dst = TrainLayout(*src), GenLayout(tp=dst_tp, replicas=2)
    plan = plan_reshard(src, dst, specs, TINY.num_layers, bucket_bytes=2048)
    _coverage(plan, specs, dst)
    for b in plan.buckets:  # a bucket is one broadcast: every transfer shares sender and group
        assert {b.sender, *{p.rank for t in b.transfers for p in t.placements}} == set(b.members)
        assert b.numel * plan.itemsize <= 2048 or len(b.transfers) == 1


def test_senders_are_balanced_over_data_parallel_copies():
    specs = qwen2_specs(MODELS["small"])
    plan = plan_reshard(TrainLayout(dp=4, tp=1, pp=1), GenLayout(tp=1, replicas=2), specs,
                        MODELS["small"].num_layers)
    sent = [plan.bytes_sent(r) for r in range(4)]
    biggest = max(s.numel for s in specs) * 4
    assert max(sent) - min(sent) <= biggest
    assert min(sent) > 0


def test_same_node_sender_preferred():
    specs = qwen2_specs(TINY)
    plan = plan_reshard(TrainLayout(dp=2), GenLayout(tp=1, replicas=2), specs, TINY.num_layers,
                        src_nodes=["a", "b"], dst_nodes=["a", "b"])
    for t in (t for b in plan.buckets for t in b.transfers):
        assert t.sender in (0, 1)
    # each replica needs everything; the plan sends one broadcast per region to both replicas
    assert all(len(b.members) == 3 for b in plan.buckets)
    plan = plan_reshard(TrainLayout(dp=2), GenLayout(tp=1, replicas=1), specs, TINY.num_layers,
                        src_nodes=["a", "b"], dst_nodes=["b"])
    assert {b.sender for b in plan.buckets} == {1}


@pytest.mark.parametrize("src, dst, match", [
    (TrainLayout(tp=4), GenLayout(tp=3), "do not divide each other"),
    (TrainLayout(tp=3), GenLayout(tp=1), "does not divide"),
    (TrainLayout(pp=3), GenLayout(tp=1), "more than the model's 2 layers"),
])
def test_plan_errors(src, dst, match):
    with pytest.raises(LayoutError, match=match):
        plan_reshard(src, dst, qwen2_specs(TINY), TINY.num_layers)


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


def test_the_check_catches_wrong_data():
    bad, _ = run_check(TrainLayout(2, 2, 1), GenLayout(2, 1), TINY, threads=True, corrupt_rank=1)
    assert bad and all("max abs diff" in b for b in bad)


def test_check_command_with_processes():
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", "--src", "dp=2,tp=2,pp=1",
                        "--dst", "tp=2,replicas=2"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok:")
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", "--src", "tp=4",
                        "--dst", "tp=3"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "do not divide each other" in r.stderr
