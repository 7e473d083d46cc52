"""Resharding from megatron-core sources: the plan reads each region from the sender's own
megatron tensors, and the check is bit-exact over a matrix of sources and destinations."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from system.errors import ConfigError
from system.reshard.check import run_check
from system.reshard.layout import GenLayout, LayoutError, TrainLayout
from system.reshard.params import ModelShape
from system.reshard.spec import WeightSyncSpec
from tests.helpers import REPO

# 8 heads in 4 query groups, 4 layers, a vocabulary that megatron pads (104 -> 128 x tp)
SHAPE = ModelShape(vocab_size=104, hidden_size=32, intermediate_size=64, num_layers=4,
                   num_heads=8, num_kv_heads=4, head_dim=8, qkv_bias=True)
TIED = dataclasses.replace(SHAPE, tie_word_embeddings=True, qkv_bias=False)
QWEN3 = dataclasses.replace(TIED, qk_norm=True)  # per-head q_norm/k_norm, no qkv bias
SHAPES = {"gqa_bias": SHAPE, "tied": TIED, "qwen3": QWEN3}
SRC = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 4, 1), (1, 1, 2), (2, 2, 1), (1, 2, 2), (2, 2, 2),
       (1, 1, 4)]
DST = [(1, 1), (1, 2), (2, 1), (4, 2), (8, 1)]


def _spec(src: tuple[int, int, int], dst: tuple[int, int], shape: ModelShape = SHAPE,
          bucket_bytes: int = 4096) -> WeightSyncSpec:
    return WeightSyncSpec(TrainLayout(*src), GenLayout(*dst), shape, "float32", "gloo", "fast",
                          bucket_bytes, 60, src_backend="megatron")


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("dst", DST)
def test_plan_reads_each_region_from_the_senders_own_tensors(src, dst):
    spec = _spec(src, dst)
    plan = spec.plan(direct_bytes=512)
    S = spec.src.world_size
    own = {r: {p.name: p for p in spec.src_params(r)} for r in range(S)}
    written = {r: {p.name: torch.zeros(p.shape, dtype=torch.int32)
                   for p in spec.dst_params(spec.dst.coord(r - S)[1])}
               for r in range(S, spec.world_size)}
    for b in plan.buckets:
        for t in b.transfers:
            src_param = own[t.sender][t.source.param]  # a tensor the sender itself holds
            piece = next(pc for pc in src_param.pieces if pc.source == t.param
                         and all(a0 <= a and b1 <= b0 for (a, b1), (a0, b0) in zip(t.box, pc.box)))
            offset = t.box[piece.dim][0] - piece.box[piece.dim][0] + piece.offset
            assert t.source.box[piece.dim][0] == offset
            for p in t.placements:
                written[p.rank][p.param][tuple(slice(a, c) for a, c in p.box)] += 1
    for rank, params in written.items():
        for name, count in params.items():
            assert torch.all(count == 1), f"rank {rank} {name}: {count.min()}..{count.max()}"


@pytest.mark.parametrize("src", SRC)
@pytest.mark.parametrize("dst", [(1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_megatron_to_vllm_is_bit_exact(src, dst, shape):
    bad, fig = run_check(TrainLayout(*src), GenLayout(*dst), SHAPES[shape], bucket_bytes=4096,
                         direct_bytes=512, threads=True, src_backend="megatron")
    assert not bad, bad
    assert fig["buckets"] > 0


def test_the_check_catches_a_wrong_megatron_shard():
    bad, _ = run_check(TrainLayout(1, 2, 2), GenLayout(2, 1), SHAPE, threads=True,
                       corrupt_rank=3, src_backend="megatron")
    assert bad and all("max abs diff" in b for b in bad)


@pytest.mark.parametrize("src,words", [((1, 8, 1), "query groups"), ((1, 1, 3), "layers"),
                                       ((1, 3, 1), "query groups")])
def test_splits_that_cannot_work_are_refused(src, words):
    with pytest.raises(LayoutError, match=words):
        _spec(src, (1, 1))


def test_megatron_with_fsdp_chunks_is_refused():
    with pytest.raises(ConfigError, match="fsdp=1"):
        WeightSyncSpec(TrainLayout(2, 1, 1, fsdp=True), GenLayout(1, 1), SHAPE, "float32",
                       "gloo", "fast", 4096, 60, src_backend="megatron")


@pytest.mark.slow  # processes: about 40 s on a busy two-core machine
def test_check_command_megatron_with_processes():
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", "--src-backend",
                        "megatron", "--src", "dp=2,tp=2,pp=2", "--dst", "tp=2,replicas=2",
                        "--model", "small"], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok: megatron dp=2,tp=2,pp=2")
    r = subprocess.run([sys.executable, "-m", "system.reshard", "check", "--src-backend",
                        "megatron", "--src", "tp=4", "--dst", "tp=1"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "query groups" in r.stderr

