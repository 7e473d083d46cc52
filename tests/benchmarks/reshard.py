"""Resharding benchmark: ours vs the naive approach vs the link, side by side in one run.

    .venv/bin/python tests/benchmarks/reshard.py [--src dp=2,tp=2,pp=1] [--dst tp=2,replicas=2]
                                                 [--model medium] [--backend gloo|nccl]

Prints ``name: value`` lines:
- speedup_vs_naive: wall time of the naive approach (gather the full state dict on rank 0, then
  broadcast tensor by tensor to every generation rank, which slices what it needs) / ours.
- fraction_of_link: bytes received per generation rank per second by ours / the same figure for
  one broadcast of a flat buffer of the same size on a group of the same ranks.
- peak_extra_memory_fraction_*: the largest transfer buffers a rank holds at once / that rank's
  parameter bytes (ours: in-flight buckets; naive: rank 0's full state dict).
- megatron_publish_peak_extra_MiB_*: with ``--megatron dp=..,tp=..,pp=..``, for a megatron-core
  source (each rank holding its own GPTModel tensors: fused qkv, [gate; up], padded vocabulary)
  publishing into ``--dst``, the most memory a rank held beyond its own tensors during one
  publish (peak resident set minus the resident set before it, the kernel's high-water mark
  reset just before; CUDA: peak allocated), for the full-gather path (every shard to rank 0,
  which rebuilds the HF model with ``megatron_shards_to_hf`` and broadcasts it tensor by tensor)
  and for ours (each rank sends its own slices through the planner), side by side in one run,
  against the target 1/dp of the model plus one bucket. ``--megatron-only`` runs just this part.
- fsdp_publish_peak_extra_MiB_*: for an FSDP2 source (real torch engines, ``--fsdp-dp`` ranks, a
  random model of ``--model``'s shapes, publishing into ``--dst``), the most memory a training
  rank held beyond its own shards during one publish (peak resident set minus the resident set
  before it, the kernel's high-water mark reset just before; CUDA: peak allocated), for the old
  path (``full_state_dict()`` on every rank, then the planner for replicated dp) and the new one
  (each rank's own dim-0 chunks through the planner), side by side in one run, against the
  target 1/dp of the model plus one bucket. ``--fsdp-only`` runs just this part.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from system.reshard.params import (box_shape, qwen2_specs, tp_box, train_shard_boxes,  # noqa: E402
                                   vllm_local_params)
from system.reshard.check import MODELS, reference  # noqa: E402
from system.reshard.executor import GroupFactory, ReshardExecutor  # noqa: E402
from system.reshard.plan import plan_reshard  # noqa: E402
from system.reshard.layout import parse_gen_layout, parse_train_layout  # noqa: E402
from tests.benchmarks.publish_memory import fsdp_publish_memory, megatron_publish_memory  # noqa
from tests.benchmarks.ranks import host_barrier, rank_device, sl, spawn  # noqa: E402


def worker(rank, args, port, out):
    torch.set_num_threads(1)
    src, dst = parse_train_layout(args.src), parse_gen_layout(args.dst)
    S, world = src.world_size, src.world_size + dst.world_size
    shape = MODELS[args.model]
    specs = qwen2_specs(shape)
    dev = rank_device(rank, args.backend)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    groups = GroupFactory(store, rank, args.backend, 600)
    everyone = groups.get(tuple(range(world)))
    plan = plan_reshard(src, dst, specs, shape.num_layers, bucket_bytes=args.bucket_mb << 20,
                        direct_bytes=int(args.direct_mb * (1 << 20)))
    ex = ReshardExecutor(plan, rank, groups, device=dev, inflight=args.inflight,
                         lanes=args.lanes)
    by_name = {s.name: s for s in specs}
    # this rank's own tensors
    if rank < S:
        boxes = train_shard_boxes(specs, src, rank, shape.num_layers)
        shards = {n: reference(by_name[n], 0, torch.float32)[sl(b)].clone().to(dev)
                  for n, b in boxes.items()}
        own_bytes = sum(t.numel() * 4 for t in shards.values())
    else:
        _, tp = dst.coord(rank - S)
        params = vllm_local_params(specs, dst.tp, tp)
        local = {p.name: torch.zeros(p.shape, device=dev) for p in params}
        own_bytes = sum(t.numel() * 4 for t in local.values())

    def barrier():
        host_barrier(everyone, args.backend, dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    res = {"rank": rank, "own_bytes": own_bytes}
    root_members = tuple([0] + list(range(S, world)))
    root_group = groups.get(root_members) if rank in root_members else None
    tp0 = [src.rank(0, t, p) for p in range(src.pp) for t in range(src.tp)]
    nbytes = plan.bytes_received(S)
    flat = torch.ones(nbytes // 4, device=dev)

    def ours():
        stats = ex.run(src=shards, src_boxes=boxes) if rank < S else ex.run(dst=local)
        res["ours_peak_buffer"] = stats.peak_buffer_bytes
        res["ours_bytes_received"] = stats.bytes_received

    def naive():
        # gather full tensors on rank 0, broadcast each to every generation rank
        peak = 0
        full_cache = {}
        for s in specs:  # 1. gather: rank 0 collects every tp shard of every stage
            stage_ranks = [r for r in tp0 if src.coord(r).pp == _stage(s, shape, src)]
            if rank == 0:
                parts = []
                for r in stage_ranks:
                    box = tp_box(s, src.tp, src.coord(r).tp)
                    if r == 0:
                        parts.append((box, shards[s.name]))
                    else:
                        buf = torch.empty(box_shape(box), device=dev)
                        everyone.recv([buf], r, 0).wait()
                        parts.append((box, buf))
                full = torch.empty(s.shape, device=dev)
                for box, part in parts:
                    full[sl(box)] = part
                full_cache[s.name] = full
                peak += full.numel() * 4
            elif rank in stage_ranks:
                everyone.send([shards[s.name].contiguous()], 0, 0).wait()
        for s in specs:  # 2. broadcast tensor by tensor
            if rank == 0:
                buf = full_cache[s.name]
            elif rank >= S:
                buf = torch.empty(s.shape, device=dev)
            else:
                continue
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            root_group.broadcast([buf], opts).wait()
            if rank >= S:  # keep only this rank's shard
                for p in params:
                    for pc in p.pieces:
                        if pc.source == s.name:
                            n = box_shape(pc.box)[0]
                            local[p.name][pc.offset:pc.offset + n] = buf[sl(pc.box)]
        res["naive_peak_buffer"] = peak

    def link():
        # one flat broadcast of the same per-destination byte count, from rank 0
        if rank == 0 or rank >= S:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            root_group.broadcast([flat], opts).wait()

    # rounds interleave the three, so a slow patch of the machine hits all of them alike;
    # the first round is warm-up
    for i in range(args.repeat + 1):
        for name, fn in (("ours", ours), ("naive", naive), ("link", link)):
            barrier()
            t = time.perf_counter()
            fn()
            sync()
            barrier()
            if i:
                res.setdefault(name, []).append(time.perf_counter() - t)
    res["link_bytes"] = nbytes
    out.put(res)


def _stage(spec, shape, src):
    from system.reshard.params import stage_of

    return stage_of(spec, shape.num_layers, src.pp)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--src", default="dp=2,tp=2,pp=1")
    p.add_argument("--dst", default="tp=2,replicas=2")
    p.add_argument("--model", default="medium", choices=sorted(MODELS))
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--repeat", type=int, default=11)
    p.add_argument("--inflight", type=int, default=4, help="broadcasts in flight per rank")
    p.add_argument("--lanes", type=int, default=None,
                   help="groups per member set (default: 2 on gloo, 1 on nccl)")
    p.add_argument("--direct-mb", type=float, default=1.0,
                   help="regions at least this large travel alone, unpacked")
    p.add_argument("--megatron", default="dp=2,tp=2,pp=1",
                   help="megatron source of the publish-memory part ('' to skip it)")
    p.add_argument("--megatron-only", action="store_true",
                   help="only the megatron publish-memory part (with --fsdp-only: both)")
    p.add_argument("--fsdp-dp", type=int, default=2,
                   help="FSDP2 ranks of the publish-memory part (0: skip it)")
    p.add_argument("--fsdp-only", action="store_true",
                   help="only the FSDP2 publish-memory part (with --megatron-only: both)")
    args = p.parse_args()
    if args.megatron and (args.megatron_only or not args.fsdp_only):
        megatron_publish_memory(args)
    if args.fsdp_dp and (args.fsdp_only or not args.megatron_only):
        fsdp_publish_memory(args)
    if args.megatron_only or args.fsdp_only:
        return
    src, dst = parse_train_layout(args.src), parse_gen_layout(args.dst)
    world = src.world_size + dst.world_size
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    results = spawn(worker, world, (args, store.port))
    S = src.world_size
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    ours = med(results[0]["ours"])
    naive = med(results[0]["naive"])
    link = med(results[0]["link"])
    per_dst = results[S]["ours_bytes_received"]
    print(f"layouts: {src} -> {dst}, model {args.model}, backend {args.backend}, "
          f"{world} processes, bucket {args.bucket_mb} MiB, in flight {args.inflight}, "
          f"lanes {args.lanes or ('2' if args.backend == 'gloo' else '1')}")
    print(f"bytes_per_generation_rank_MiB: {per_dst / 2**20:.1f}")
    print(f"ours_s: {ours:.3f}")
    print(f"naive_s: {naive:.3f}")
    print(f"speedup_vs_naive: {naive / ours:.2f}")
    print(f"ours_GBps_per_generation_rank: {per_dst / ours / 1e9:.3f}")
    print(f"link_GBps_per_generation_rank: {results[0]['link_bytes'] / link / 1e9:.3f}")
    print(f"fraction_of_link: {(per_dst / ours) / (results[0]['link_bytes'] / link):.2f}")
    ours_frac = max(r["ours_peak_buffer"] / r["own_bytes"] for r in results)
    print(f"peak_extra_memory_fraction_ours_max_rank: {ours_frac:.2f}")
    print(f"peak_extra_memory_fraction_naive_rank0: "
          f"{results[0]['naive_peak_buffer'] / results[0]['own_bytes']:.2f}")


if __name__ == "__main__":
    main()
