"""(c) The megatron-core engine: tp=1 against a float32 Hugging Face forward, tp=2 against tp=1.

Each layout runs as real processes (one per rank; NCCL with one GPU each on ``cuda``, gloo on
``cpu``) with ``workers.engines.megatron_engine.MegatronEngine`` (as
``tests/workers/engines/test_megatron_engine.py`` does): per-token log-probs of fixed random
sequences, one training step (token-mean NLL, lr 1e-3), the log-probs again.

- ``megatron_tp1``: tp=1 log-probs against a float32 HF forward of each sequence alone.
- ``megatron_tp2``: tp=2 against tp=1: log-probs before and after the step, and the step's loss.
  With two GPUs the ranks use one each over NCCL. With one GPU both ranks compute on it and talk
  over gloo (NCCL refuses two ranks on one GPU), and only the log-probs are compared, with no
  step: the bf16 CUDA kernels of the tp=2 split are checked, NCCL and the step are not, and the
  verdict says so. (On an H200 with torch 2.11 a step there segfaulted: gloo inside torch's
  ``_coalescing_manager``, the distributed optimizer's coalesced parameter all-gather, although
  each collective alone worked on CUDA tensors in fp32 and bf16; forward and backward ran.)

Thresholds: on CUDA (bfloat16 compute over float32 masters) mean |diff| <= 0.03 and max <= 0.25
(as the torch engine's parity check), loss within 1%; on CPU (float32) max |diff| <= 1e-4 and
the loss within 1e-4 (relative). SKIP: no CUDA, megatron-core not importable. FAIL: a
megatron-core other than the pinned release (the engine refuses it).

    python3 -m scripts.gpu_checks.megatron_tp [--device cuda|cpu] [--model .models/arith-tiny]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from scripts.gpu_checks.common import (Verdict, abs_diffs, base_parser, cuda_devices, device_skip,
                                       exit_code, free_port, kill_group, model_skip, need, out,
                                       random_seqs, reference_logprobs, sft_loss, start_group)

CHECKS = ("megatron_tp1", "megatron_tp2")
LR = 1e-3
TOLS = {"cuda": {"mean": 0.03, "max": 0.25, "loss_rel": 1e-2},
        "cpu": {"mean": 1e-4, "max": 1e-4, "loss_rel": 1e-4}}


def seqs_for(model: str) -> list[Any]:
    with open(os.path.join(model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    return random_seqs(8, 5, 40, vocab, seed=0)


def worker(args: Any) -> None:
    """One rank of a ``--tp`` layout; rank 0 writes ``tp<T>.safetensors`` / ``.json``."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from workers.engines.configs import MegatronConfig, TorchEngineConfig
    from workers.engines.megatron_engine import MegatronEngine

    rank, world = args.worker, args.world
    backend, gpu = rank_layout(args.device, rank, world, args.gpus)
    device = "cpu" if gpu is None else f"cuda:{gpu}"
    if gpu is not None:
        torch.cuda.set_device(gpu)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", args.port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    cfg = TorchEngineConfig(model_path=args.model, lr=LR, max_tokens_per_microbatch=160,
                            backend="megatron", megatron=MegatronConfig(tp=args.tp, pp=1))
    eng = MegatronEngine(cfg, device, world_size=world)
    seqs = seqs_for(args.model)
    tokens = sum(len(s) - 1 for s in seqs)
    before = eng.logprobs(seqs)
    stats, after = {"loss": float("nan"), "grad_norm": float("nan")}, []
    if args.steps:
        stats = eng.train_step(seqs, sft_loss, tokens)
        after = eng.logprobs(seqs)
    if rank == 0:
        tensors = {f"before_{i}": t.float().cpu().contiguous() for i, t in enumerate(before)}
        tensors.update({f"after_{i}": t.float().cpu().contiguous() for i, t in enumerate(after)})
        save_file(tensors, os.path.join(args.out, f"tp{args.tp}.safetensors"))
        with open(os.path.join(args.out, f"tp{args.tp}.json"), "w") as f:
            json.dump({"loss": float(stats["loss"]), "grad_norm": float(stats["grad_norm"]),
                       "dtype": str(eng.dtype), "master_dtype": str(eng.master_dtype)}, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def rank_layout(device: str, rank: int, world: int, gpus: int) -> tuple[str, int | None]:
    """The group backend and the CUDA device (``None``: the CPU) of ``rank`` of ``world`` ranks
    when ``gpus`` GPUs are visible: a GPU each over NCCL when there are enough, else every rank
    on GPU 0 over gloo (NCCL refuses two ranks of one group on one GPU)."""
    if device != "cuda":
        return "gloo", None
    if gpus < 1:
        raise ValueError("no CUDA device for the megatron check")
    return ("nccl", rank) if world <= gpus else ("gloo", 0)


def tp2_note(device: str, gpus: int) -> str:
    """What a tp=2 verdict leaves unchecked on this machine ('' when nothing)."""
    if device == "cuda" and gpus < 2:
        return (f"{gpus} GPU: both ranks on it over gloo, log-probs only; NCCL and the step "
                "unchecked (NCCL refuses two ranks on one GPU)")
    return ""


def run_layout(args: Any, tp: int, directory: str, steps: int = 1) -> dict[str, Any]:
    """Run tp=``tp`` (``tp`` processes; ``steps``: 1, or 0 for log-probs alone) and read rank
    0's results."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120)) if tp > 1 else None
    port = store.port if store is not None else free_port()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONFAULTHANDLER="1")  # a rank that crashes prints its Python stack
    # each rank writes to a file of its own (a full pipe cannot stall a rank in a collective),
    # in a process group of its own (killed at the deadline, all of them)
    logs = [open(os.path.join(directory, f"tp{tp}-rank{r}.log"), "w+b") for r in range(tp)]
    procs = [start_group([sys.executable, "-m", "scripts.gpu_checks.megatron_tp",
                          "--worker", str(r), "--world", str(tp), "--tp", str(tp),
                          "--port", str(port), "--out", directory, "--device", args.device,
                          "--gpus", str(args.gpus), "--steps", str(steps),
                          "--model", args.model], logs[r], env)
             for r in range(tp)]
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"tp={tp} ran past {args.timeout:.0f}s") from None
    finally:
        for p in procs:
            kill_group(p.pid)
            p.wait()
    texts = []
    for f in logs:
        f.seek(0)
        texts.append(f.read().decode(errors="replace"))
        f.close()
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        lines = texts[bad[0][0]].strip().splitlines() or ["no output"]
        print(f"== tp={tp} rank {bad[0][0]} (exit {bad[0][1]}), its last lines:", flush=True)
        print("\n".join(lines[-40:]), flush=True)
        last = lines[-1]
        raise RuntimeError(f"tp={tp} rank {bad[0][0]} exited {bad[0][1]}: {last}")
    t = load_file(os.path.join(directory, f"tp{tp}.safetensors"))
    with open(os.path.join(directory, f"tp{tp}.json")) as f:
        meta = json.load(f)
    n = len([k for k in t if k.startswith("before_")])
    return {**meta, "before": [t[f"before_{i}"] for i in range(n)],
            "after": [t[f"after_{i}"] for i in range(n) if f"after_{i}" in t]}


def within(name: str, got: list[Any], want: list[Any], tol: dict[str, float]) -> bool:
    mean, mx = abs_diffs(got, want)
    out(f"{name}_mean_abs_diff", mean)
    out(f"{name}_max_abs_diff", mx)
    return mean <= tol["mean"] and mx <= tol["max"]


def check_tp1(res: dict[str, Any], ref: list[Any], tol: dict[str, float]) -> Verdict:
    out("megatron_tp1_dtype", f"{res['dtype']} compute, {res['master_dtype']} master")
    ok = within("megatron_tp1_vs_hf_fp32", res["before"], ref, tol)
    return Verdict("megatron_tp1", "PASS" if ok else "FAIL",
                   "" if ok else f"log-probs differ from HF float32 beyond {tol}")


def check_tp2(tp2: dict[str, Any], tp1: dict[str, Any], tol: dict[str, float],
              note: str = "") -> Verdict:
    ok = within("megatron_tp2_vs_tp1_before", tp2["before"], tp1["before"], tol)
    if tp2["after"]:
        ok = within("megatron_tp2_vs_tp1_after_step", tp2["after"], tp1["after"], tol) and ok
        rel = abs(tp2["loss"] - tp1["loss"]) / max(abs(tp1["loss"]), 1e-12)
        out("megatron_loss", f"tp1 {tp1['loss']:.6g}, tp2 {tp2['loss']:.6g} (rel diff {rel:.2g})")
        ok = ok and rel <= tol["loss_rel"]
    why = "" if ok else f"tp=2 differs from tp=1 beyond {tol}"
    return Verdict("megatron_tp2", "PASS" if ok else "FAIL",
                   "; ".join(w for w in (why, note) if w))


def run(args: Any) -> list[Verdict]:
    why = (device_skip(args.device)
           or need("megatron.core", "workers.engines.megatron_engine"))
    if why is None:
        from workers.engines import megatron_compat

        try:
            megatron_compat.check_version()
        except Exception as e:  # installed, but not the pinned version: the engine refuses
            return [Verdict(c, "FAIL", str(e).splitlines()[0]) for c in CHECKS]
    why = why or model_skip(args.model)
    if why:
        return [Verdict(c, "SKIP", why) for c in CHECKS]
    tol = TOLS[args.device]
    args.gpus = cuda_devices() if args.device == "cuda" else 0
    seqs = seqs_for(args.model)
    ref = reference_logprobs(args.model, seqs)
    verdicts = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-megatron-") as d:
        try:
            tp1 = run_layout(args, 1, d)
        except RuntimeError as e:
            return [Verdict(c, "FAIL", str(e)) for c in CHECKS]
        verdicts.append(check_tp1(tp1, ref, tol))
        note = tp2_note(args.device, args.gpus)
        if note:
            out("megatron_tp2_layout", note)
        try:
            tp2 = run_layout(args, 2, d, steps=0 if note else 1)
            verdicts.append(check_tp2(tp2, tp1, tol, note))
        except RuntimeError as e:
            verdicts.append(Verdict("megatron_tp2", "FAIL", str(e)))
    return verdicts


def main() -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per layout")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--gpus", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args)
        return 0
    verdicts = [v.show() for v in run(args)]
    return exit_code(verdicts)


if __name__ == "__main__":
    sys.exit(main())
