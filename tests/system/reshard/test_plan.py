"""Resharding: the pure planner (coverage, buckets, balance, locality, errors)."""
from __future__ import annotations

import pytest
import torch

from system.reshard.params import qwen2_specs, train_shard_boxes, vllm_local_params
from system.reshard.check import MODELS
from system.reshard.plan import Placement, plan_reshard
from system.reshard.layout import GenLayout, LayoutError, TrainLayout

TINY = MODELS["tiny"]
SRC = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 1, 2)]


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


@pytest.mark.parametrize("src", [TrainLayout(dp=2, fsdp=True), TrainLayout(dp=3, fsdp=True),
                                 TrainLayout(dp=2, tp=2, fsdp=True),
                                 TrainLayout(dp=3, pp=2, fsdp=True)])
@pytest.mark.parametrize("dst_tp", [1, 2, 4])
def test_fsdp_plan_sends_each_region_from_the_chunk_holding_it(src, dst_tp):
    """With FSDP2 sources every region comes from the one rank whose dim-0 chunk holds it (no
    rank sends what it does not hold), and every destination element is written once."""
    specs = qwen2_specs(TINY)
    dst = GenLayout(tp=dst_tp, replicas=2)
    plan = plan_reshard(src, dst, specs, TINY.num_layers, bucket_bytes=2048)
    _coverage(plan, specs, dst)
    held = {r: train_shard_boxes(specs, src, r, TINY.num_layers) for r in range(src.world_size)}
    for t in (t for b in plan.buckets for t in b.transfers):
        box = held[t.sender][t.param]
        assert all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(t.box, box)), t
        # read from the sender's own chunk, relative to where the chunk starts
        assert t.source == Placement(t.sender, t.param, tuple(
            (a - a0, b - a0) for (a, b), (a0, _) in zip(t.box, box))), t
    assert all(plan.bytes_sent(r) > 0 for r in range(src.world_size))
