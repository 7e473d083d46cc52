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
import multiprocessing as mp
import os
import socket
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
from system.reshard.layout import TrainLayout, parse_gen_layout, parse_train_layout  # noqa: E402


def _sl(box):
    return tuple(slice(a, b) for a, b in box)


def _barrier(group, backend: str, dev) -> None:
    """Every rank of ``group`` arrives; NCCL's wait() only orders streams: the host waits for
    the allreduce."""
    if backend == "gloo":
        group.barrier().wait()
    else:
        group.allreduce([torch.zeros(1, device=dev)]).wait()
        torch.cuda.synchronize(dev)


def worker(rank, args, port, out):
    torch.set_num_threads(1)
    src, dst = parse_train_layout(args.src), parse_gen_layout(args.dst)
    S, world = src.world_size, src.world_size + dst.world_size
    shape = MODELS[args.model]
    specs = qwen2_specs(shape)
    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count())) \
        if args.backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":  # NCCL's own allocations and barriers go to the current device
        torch.cuda.set_device(dev)
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
        shards = {n: reference(by_name[n], 0, torch.float32)[_sl(b)].clone().to(dev)
                  for n, b in boxes.items()}
        own_bytes = sum(t.numel() * 4 for t in shards.values())
    else:
        _, tp = dst.coord(rank - S)
        params = vllm_local_params(specs, dst.tp, tp)
        local = {p.name: torch.zeros(p.shape, device=dev) for p in params}
        own_bytes = sum(t.numel() * 4 for t in local.values())

    def barrier():
        _barrier(everyone, args.backend, dev)

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
                    full[_sl(box)] = part
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
                            local[p.name][pc.offset:pc.offset + n] = buf[_sl(pc.box)]
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
    results = _spawn(worker, world, (args, store.port))
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


# --- peak extra memory of a publish (megatron and FSDP2 sources) ---------------------------

def _peak_reset(dev) -> int:
    """Reset the peak-memory mark; the memory in use now (bytes)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    return _proc_status("VmRSS")


def _peak(dev) -> int:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    return _proc_status("VmHWM")


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# --- megatron source: full-gather publish vs shard-to-shard -----------------------------------

def _mg_worker(rank, spec, args, port, out):
    from system.reshard.check import source_tensors
    from system.reshard.megatron import megatron_shards_to_hf

    torch.set_num_threads(1)
    S, world = spec.src.world_size, spec.world_size
    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count())) \
        if args.backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":  # NCCL's own allocations and barriers go to the current device
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    groups = GroupFactory(store, rank, args.backend, 600)
    everyone = groups.get(tuple(range(world)))
    root_members = tuple([0] + list(range(S, world)))
    root_group = groups.get(root_members) if rank in root_members else None
    ex = ReshardExecutor(spec.plan(direct_bytes=int(args.direct_mb * (1 << 20))), rank, groups,
                         device=dev, inflight=args.inflight, lanes=args.lanes)
    if rank < S:
        own = {n: t.to(dev) for n, t in source_tensors(spec, rank, 0).items()}
    else:
        params = spec.dst_params(spec.dst.coord(rank - S)[1])
        own = {p.name: torch.zeros(p.shape, device=dev) for p in params}
    specs = spec.specs()

    def barrier():
        _barrier(everyone, args.backend, dev)

    def ours():
        ex.run(src=own) if rank < S else ex.run(dst=own)

    def gather():
        full = {}
        if rank == 0:  # every rank's megatron tensors, then the HF model rebuilt from them
            shards = {}
            for r in range(S):
                c = spec.src.coord(r)
                if c.dp or (c.tp, c.pp) in shards:
                    continue
                if r == 0:
                    shards[(c.tp, c.pp)] = own
                    continue
                shards[(c.tp, c.pp)] = {}
                for p in spec.src_params(r):
                    buf = torch.empty(p.shape, device=dev)
                    everyone.recv([buf], r, 0).wait()
                    shards[(c.tp, c.pp)][p.name] = buf
            full = megatron_shards_to_hf({k: {n: t.cpu() for n, t in v.items()}
                                          for k, v in shards.items()}, spec.shape, spec.src.tp,
                                         spec.src.pp, spec.vocab_divisible_by)
            del shards
        elif rank < S and spec.src.coord(rank).dp == 0:
            for p in spec.src_params(rank):
                everyone.send([own[p.name].contiguous()], 0, 0).wait()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for s in specs:  # tensor by tensor; a generation rank keeps its slices
            if rank == 0:
                root_group.broadcast([full[s.name].to(dev)], opts).wait()
            elif rank >= S:
                buf = torch.empty(s.shape, device=dev)
                root_group.broadcast([buf], opts).wait()
                for p in params:
                    for pc in p.pieces:
                        if pc.source == s.name:
                            n = box_shape(pc.box)[0]
                            own[p.name][pc.offset:pc.offset + n] = buf[_sl(pc.box)]

    res = {"rank": rank, "own_bytes": sum(t.numel() * 4 for t in own.values())}
    for i in range(args.repeat + 1):  # the first round warms up (groups, allocator)
        for name, fn in (("gather", gather), ("ours", ours)):
            barrier()
            before = _peak_reset(dev)
            fn()
            extra = _peak(dev) - before
            barrier()
            if i:
                res[name] = max(res.get(name, 0), extra)
    out.put(res)


def megatron_publish_memory(args) -> None:
    """Peak extra memory per rank of one publish from a megatron source, full gather vs ours."""
    from system.reshard.spec import WeightSyncSpec

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors leave the RSS
    shape = MODELS[args.model]
    spec = WeightSyncSpec(parse_train_layout(args.megatron), parse_gen_layout(args.dst), shape,
                          "float32", args.backend, "fast", args.bucket_mb << 20, 600,
                          src_backend="megatron")
    world = spec.world_size
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    results = _spawn(_mg_worker, world, (spec, args, store.port))
    S, mib = spec.src.world_size, 2 ** 20
    model = sum(s.numel for s in spec.specs()) * 4
    bucket = min(args.bucket_mb << 20, model)
    src_ours = max(r["ours"] for r in results[:S])
    print(f"megatron source {spec.src} -> {spec.dst}, model {args.model} "
          f"({model / mib:.1f} MiB), backend {args.backend}, bucket {bucket / mib:.1f} MiB")
    print(f"megatron_own_tensors_MiB_per_training_rank: "
          f"{max(r['own_bytes'] for r in results[:S]) / mib:.1f}")
    print(f"megatron_publish_peak_extra_MiB_gather_rank0: {results[0]['gather'] / mib:.1f}")
    print(f"megatron_publish_peak_extra_MiB_gather_max_generation_rank: "
          f"{max(r['gather'] for r in results[S:]) / mib:.1f}")
    print(f"megatron_publish_peak_extra_MiB_ours_max_training_rank: {src_ours / mib:.1f}")
    print(f"megatron_publish_peak_extra_MiB_ours_max_generation_rank: "
          f"{max(r['ours'] for r in results[S:]) / mib:.1f}")
    target = model / spec.src.dp + bucket
    print(f"megatron_publish_target_MiB (model/dp + bucket): {target / mib:.1f}: "
          f"{'met' if src_ours <= target else 'MISSED'}")


# --- FSDP2 source: old full-gather publish vs shard publish --------------------------------

def _fsdp_rank(rank, args, model_dir, ports, out):
    """A training rank (a real FSDP2 torch engine) or a generation rank; publishes with each
    path ``args.repeat`` times (after one warm-up each) and reports the peaks."""
    from system.reshard.spec import WeightSyncSpec
    from workers.publish import send_shards, source_boxes

    torch.set_num_threads(1)
    dp, dst = args.fsdp_dp, parse_gen_layout(args.dst)
    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count())) \
        if args.backend == "nccl" else torch.device("cpu")
    shape = MODELS[args.model]
    wire = dict(shape=shape, dtype="float32", backend=args.backend, mode="fast",
                bucket_bytes=args.bucket_mb << 20, timeout=600)
    new = WeightSyncSpec(src=TrainLayout(dp=dp, fsdp=True), dst=dst, **wire)
    old = WeightSyncSpec(src=TrainLayout(dp=dp), dst=dst, **wire)
    store = dist.TCPStore("127.0.0.1", ports[0], new.world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=600))
    ex_new = new.executor(rank, dist.PrefixStore("new", store), dev)
    ex_old = old.executor(rank, dist.PrefixStore("old", store), dev)
    everyone = GroupFactory(dist.PrefixStore("all", store), rank, args.backend, 600).get(
        tuple(range(new.world_size)))
    res = {"rank": rank}
    if rank < dp:
        from workers.engines.torch_engine import TorchEngine, TorchEngineConfig

        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{ports[1]}",
                                rank=rank, world_size=dp)
        eng = TorchEngine(TorchEngineConfig(model_path=model_dir, dtype="float32"), str(dev), dp)
        boxes_new = source_boxes(new, rank, eng.local_shards())
        boxes_old = old.src_boxes(rank)
        res["own_bytes"] = sum(t.numel() * t.element_size() for t in eng.local_shards().values())

        def publish_new():
            send_shards(ex_new, eng, boxes_new)

        def publish_old():  # what send_weights did: every rank gathers the whole model
            full = eng.full_state_dict()
            ex_old.run(src={n: full[n].contiguous() for n in boxes_old}, src_boxes=boxes_old)
    else:
        _, tp = dst.coord(rank - dp)
        local = {p.name: torch.zeros(p.shape, device=dev) for p in new.dst_params(tp)}
        publish_new = lambda: ex_new.run(dst=local)  # noqa: E731
        publish_old = lambda: ex_old.run(dst=local)  # noqa: E731
    for i in range(args.repeat + 1):  # the first round is warm-up (groups, connections)
        for name, fn in (("new", publish_new), ("old", publish_old)):
            everyone.barrier().wait() if args.backend == "gloo" else None
            base = _peak_reset(dev)
            fn()
            if i:
                res.setdefault(name, []).append(_peak(dev) - base)
    out.put(res)


def fsdp_publish_memory(args) -> None:
    """Spawn ``--fsdp-dp`` FSDP2 training ranks and ``--dst`` generation ranks; print each
    training rank's peak extra memory during a publish, old path and new."""
    import tempfile

    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape, dp, dst = MODELS[args.model], args.fsdp_dp, parse_gen_layout(args.dst)
    world = dp + dst.world_size
    # big allocations straight from mmap, so a freed buffer leaves the resident set at once
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(
            vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, tie_word_embeddings=shape.tie_word_embeddings)
        ).float().save_pretrained(model_dir)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=600))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            pg_port = s.getsockname()[1]
        results = _spawn(_fsdp_rank, world, (args, model_dir, (store.port, pg_port)))
    model_bytes = sum(s.numel for s in qwen2_specs(shape)) * 4
    bucket = args.bucket_mb << 20
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"fsdp_publish: FSDP2 dp={dp} -> {dst}, model {args.model} "
          f"({model_bytes / 2**20:.1f} MiB float32), bucket {args.bucket_mb} MiB, "
          f"backend {args.backend}, median of {args.repeat}")
    target = model_bytes / dp + bucket
    print(f"fsdp_publish_target_MiB (model/dp + one bucket): {target / 2**20:.1f}")
    for r in results[:dp]:
        print(f"fsdp_publish_own_shards_MiB_rank{r['rank']}: {r['own_bytes'] / 2**20:.1f}")
        for name, label in (("old", "old_full_gather"), ("new", "new_shards")):
            print(f"fsdp_publish_peak_extra_MiB_{label}_rank{r['rank']}: "
                  f"{med(r[name]) / 2**20:.1f}")
    worst = max(med(r["new"]) for r in results[:dp])
    print(f"fsdp_publish_new_within_target: {worst <= target} "
          f"({worst / 2**20:.1f} <= {target / 2**20:.1f} MiB)")


def _spawn(fn, world, args) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, *args, out)) for r in range(world)]
    for pr in procs:
        pr.start()
    results = []
    while len(results) < world:
        try:
            results.append(out.get(timeout=5))
        except Exception:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a benchmark rank failed (exit codes {dead})")
    for pr in procs:
        pr.join()
    return sorted(results, key=lambda r: r["rank"])


if __name__ == "__main__":
    main()
