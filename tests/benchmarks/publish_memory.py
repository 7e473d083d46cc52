"""Peak extra memory per rank of one publish, for megatron and FSDP2 sources (the old
full-gather paths against ours, side by side in one run): the publish-memory part of
``tests/benchmarks/reshard.py``, which documents its output lines and runs it."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from system.reshard.check import MODELS
from system.reshard.executor import GroupFactory, ReshardExecutor
from system.reshard.layout import TrainLayout, parse_gen_layout, parse_train_layout
from system.reshard.params import box_shape, qwen2_specs
from tests.benchmarks.ranks import host_barrier, rank_device, sl, spawn


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
    dev = rank_device(rank, args.backend)
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
        host_barrier(everyone, args.backend, dev)

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
                            own[p.name][pc.offset:pc.offset + n] = buf[sl(pc.box)]

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
    results = spawn(_mg_worker, world, (spec, args, store.port))
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
    dev = rank_device(rank, args.backend)
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
        results = spawn(_fsdp_rank, world, (args, model_dir, (store.port, pg_port)))
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
