"""Weight resharding from a training layout to a generation layout, and a check anyone can run.

    python -m system.reshard check --src dp=2,tp=2,pp=1 --dst tp=2,replicas=2
    python -m system.reshard check --src dp=1,tp=2,pp=2 --dst tp=1,replicas=2 --model small
    python -m system.reshard check --src dp=3,fsdp=1 --dst tp=2,replicas=1   # FSDP2 dim-0 shards
    python -m system.reshard check --src-backend megatron --src dp=2,tp=2,pp=2 --dst tp=2,replicas=2

Spawns one process per training and generation rank, reshards a randomly initialised Qwen2-style
model (every training rank holds only its own shard: HF-named tensor-parallel shards, with
``fsdp=1`` their FSDP2 dim-0 chunks, or with ``--src-backend megatron`` megatron-core's own fused,
vocabulary-padded tensors), and compares every tensor each generation rank received
bit-exactly against the full reference. Prints ``ok`` or the mismatches; exits non-zero on any
mismatch. The planner is :mod:`system.reshard.plan`, the executor :mod:`system.reshard.executor`.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import zlib
from typing import Any

import torch

from system.errors import ConfigError
from system.name_resolve import FileNameResolve
from system.rendezvous import host_store, lookup_store
from system.reshard.executor import ReshardStats
from system.reshard.layout import GenLayout, TrainLayout, parse_gen_layout, parse_train_layout
from system.reshard.megatron import local_box
from system.reshard.params import Box, ModelShape, ParamSpec, vllm_local_params
from system.reshard.spec import WeightSyncSpec

MODELS: dict[str, ModelShape] = {
    "tiny": ModelShape(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True),
    "small": ModelShape(vocab_size=1024, hidden_size=256, intermediate_size=704, num_layers=4,
                        num_heads=8, num_kv_heads=4, head_dim=32, qkv_bias=True),
    "medium": ModelShape(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
                         num_heads=8, num_kv_heads=4, head_dim=64, qkv_bias=True),
    # Qwen2.5-0.5B's shapes (random weights): 494M parameters
    "qwen2-0.5b": ModelShape(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                             num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                             tie_word_embeddings=True, qkv_bias=True),
}
STORE_KEY = "reshard-check/store"


def reference(spec: ParamSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """The full tensor of ``spec``: deterministic in (seed, name), so every process agrees."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=g).to(dtype)


def source_tensors(spec: WeightSyncSpec, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Training ``rank``'s own tensors as its engine holds them (padding rows zero), made from
    the parts of the reference it holds."""
    dtype = getattr(torch, spec.dtype)
    by_name = {s.name: s for s in spec.specs()}
    out = {}
    for p in spec.src_params(rank):
        t = torch.zeros(p.shape, dtype=dtype)
        for pc in p.pieces:
            t[_slices(local_box(pc))] = reference(by_name[pc.source], seed, dtype)[_slices(pc.box)]
        out[p.name] = t
    return out


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
START_METHODS = ("forkserver", "spawn")
"""How rank processes start: forked from a server that imported this module (torch with it)
once, or spawned, each importing it again (``tests/benchmarks/rank_start.py`` compares them)."""


def _rank_main(rank: int, spec: WeightSyncSpec, opts: tuple[int, int | None],
               rendezvous: tuple[str, str],
               seed: int, corrupt_rank: int | None, out: Any) -> None:
    try:
        if rank == corrupt_rank:
            seed += 1  # fault injection: this rank's shards are not the reference's
        out.put((rank, *_rank_body(rank, spec, opts, rendezvous, seed)))
    except Exception as e:  # report, do not hang the parent
        out.put((rank, [f"rank {rank} failed: {type(e).__name__}: {e}"], None))


def _rank_body(rank: int, spec: WeightSyncSpec, opts: tuple[int, int | None],
               rendezvous: tuple[str, str], seed: int) -> tuple[list[str], ReshardStats]:
    """``rendezvous``: the name-resolution root where the store is published, and its key
    prefix."""
    torch.set_num_threads(1)
    nr_root, prefix = rendezvous
    store = lookup_store(FileNameResolve(nr_root, secret=None), STORE_KEY, spec.world_size,
                         120, prefix)
    dtype = getattr(torch, spec.dtype)
    executor = spec.executor(rank, store, plan=spec.plan(direct_bytes=opts[0]), lanes=opts[1])
    by_name = {s.name: s for s in spec.specs()}
    if rank < spec.src.world_size:
        return [], executor.run(src=source_tensors(spec, rank, seed))
    _, tp = spec.dst.coord(rank - spec.src.world_size)
    params = spec.dst_params(tp)
    local = {p.name: torch.full(p.shape, float("nan"), dtype=dtype) for p in params}
    stats = executor.run(dst=local)
    bad = []
    for p in params:
        want = torch.cat([reference(by_name[pc.source], seed, dtype)[
            tuple(slice(a, b) for a, b in pc.box)] for pc in p.pieces], dim=0)
        got = local[p.name]
        if got.shape != want.shape or not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().nan_to_num(float("inf")).max().item() \
                if got.shape == want.shape else "shape"
            bad.append(f"rank {rank} (generation tp {tp}) {p.name} {tuple(got.shape)}: "
                       f"max abs diff {diff}")
    return bad, stats


def run_check(src: TrainLayout, dst: GenLayout, shape: ModelShape, *, bucket_bytes: int = 256 << 20,
              direct_bytes: int = 1 << 20, dtype: torch.dtype = torch.float32,
              lanes: int | None = None, threads: bool = False, seed: int = 0,
              timeout: float = 300, corrupt_rank: int | None = None,
              src_backend: str = "fsdp", start_method: str = "forkserver"
              ) -> tuple[list[str], dict[str, int]]:
    """Run the whole reshard with one process (or thread) per rank; returns the mismatches and
    figures of the plan. ``corrupt_rank``: a training rank that sends wrong data (to show the
    check catches it). ``src_backend``: fsdp or megatron (what the training ranks hold).
    ``start_method``: how rank processes start (:data:`START_METHODS`)."""
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method={start_method!r}: one of {', '.join(START_METHODS)}")
    spec = WeightSyncSpec(src, dst, shape, DTYPES[dtype], "gloo", "fast", bucket_bytes, 120,
                          src_backend=src_backend)
    plan = spec.plan(direct_bytes=direct_bytes)  # validates first
    with tempfile.TemporaryDirectory() as nr_root:  # private (0700): no trial secret needed
        prefix = os.urandom(16).hex()  # this run's own key prefix (the trial secret's role)
        store = host_store(FileNameResolve(nr_root, secret=None), STORE_KEY, "127.0.0.1",
                           spec.world_size, timeout, prefix)
        stats = _run_ranks(spec, (direct_bytes, lanes), (nr_root, prefix), seed, corrupt_rank,
                           None if threads else start_method, timeout)
        del store
    bad = [e for errors, _ in stats.values() for e in errors]
    done = [st for _, st in stats.values() if st is not None]
    figures = {"tensors_per_dst_rank": len(vllm_local_params(spec.specs(), dst.tp, 0)),
               "buckets": len(plan.buckets), "groups": len(plan.groups),
               "bytes_per_dst_rank": plan.bytes_received(src.world_size),
               # the most any rank copied through staging buffers (packing + unpacking)
               "max_bytes_staged": max((st.bytes_packed + st.bytes_unpacked for st in done),
                                       default=0),
               "max_bytes_unpacked": max((st.bytes_unpacked for st in done), default=0)}
    return bad, figures


def _run_ranks(spec: WeightSyncSpec, opts: tuple[int, int | None],
               rendezvous: tuple[str, str], seed: int, corrupt_rank: int | None,
               start_method: str | None, timeout: float
               ) -> dict[int, tuple[list[str], ReshardStats | None]]:
    """One process per rank (started by ``start_method``), or one thread (None); each rank's
    mismatches and figures."""
    args = (spec, opts, rendezvous, seed, corrupt_rank)
    if start_method is None:
        import queue

        out: Any = queue.Queue()
        runners: list[Any] = [threading.Thread(target=_rank_main, args=(r, *args, out),
                                               daemon=True) for r in range(spec.world_size)]
    else:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload([__name__])
        out = ctx.Queue()
        runners = [ctx.Process(target=_rank_main, args=(r, *args, out))
                   for r in range(spec.world_size)]
    for r in runners:
        r.start()
    results: dict[int, tuple[list[str], ReshardStats | None]] = {}
    try:
        for _ in range(spec.world_size):
            rank, errors, st = out.get(timeout=timeout)
            results[rank] = (errors, st)
    finally:
        for r in runners:
            r.join(timeout=10)
            if isinstance(r, mp.process.BaseProcess) and r.is_alive():
                r.kill()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m system.reshard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="reshard a random model and compare bit-exactly")
    c.add_argument("--src", required=True,
                   help="training layout, e.g. dp=2,tp=2,pp=1 (fsdp=1: dp ranks hold FSDP2 "
                        "dim-0 shards, not copies)")
    c.add_argument("--src-backend", default="fsdp", choices=["fsdp", "megatron"],
                   help="what training ranks hold: HF-named shards (the torch engine), or "
                        "megatron-core's tensors")
    c.add_argument("--dst", required=True, help="generation layout, e.g. tp=2,replicas=2")
    c.add_argument("--model", default="tiny", choices=sorted(MODELS))
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--bucket-mb", type=float, default=256.0)
    c.add_argument("--direct-mb", type=float, default=1.0,
                   help="regions at least this large are sent and received in place")
    c.add_argument("--threads", action="store_true", help="ranks as threads of one process")
    c.add_argument("--start-method", default="forkserver", choices=START_METHODS,
                   help="rank processes forked from a server that imported torch once "
                        "(forkserver), or spawned, each importing it (spawn)")
    args = p.parse_args(argv)
    from system.errors import RLSystemError

    try:
        src, dst = parse_train_layout(args.src), parse_gen_layout(args.dst)
        bad, fig = run_check(src, dst, MODELS[args.model],
                             bucket_bytes=int(args.bucket_mb * (1 << 20)),
                             direct_bytes=int(args.direct_mb * (1 << 20)),
                             dtype=getattr(torch, args.dtype), threads=args.threads,
                             src_backend=args.src_backend, start_method=args.start_method)
    except RLSystemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if bad:
        print("\n".join(bad))
        print(f"MISMATCH: {len(bad)} tensor(s) differ ({args.src_backend} {src} -> {dst}, "
              f"model {args.model})")
        return 1
    print(f"ok: {args.src_backend} {src} -> {dst}, model {args.model}: "
          f"{fig['tensors_per_dst_rank']} tensors per generation rank bit-exact, "
          f"{fig['bytes_per_dst_rank'] / 2**20:.2f} MiB each, "
          f"{fig['buckets']} buckets on {fig['groups']} groups, "
          f"{fig['max_bytes_unpacked'] / 2**20:.2f} MiB unpacked on the busiest receiver")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
