"""(b) Weight sync into a real vLLM engine, with log-prob parity of the tokens vLLM samples.

A trainer (``workers.engines.torch_engine.TorchEngine``: on CUDA bfloat16 compute over float32
master weights) trains a few steps, so its weights are no longer the checkpoint's; a vLLM engine
(``workers.engines.vllm_server.GenerationEngine``, with the weight-sync worker extension of
``workers.engines.vllm_weight_sync``) samples from random prompts; the trainer's log-probs of
the same tokens are compared with those vLLM reported. Then the trainer publishes its weights
into the engine through the resharding engine (``WeightSyncSpec`` -> executor, fast mode, as
``experiments.rl.cluster.Cluster`` sets it up: one training rank, one replica, tp=1), vLLM
samples again (as weight version 1) and the comparison is repeated, then at temperature
:data:`TEMPERATURE` (vLLM's log-probs the sampled distribution's, the trainer's at it).

PASS: after the update the mean |trainer - vLLM| log-prob difference is <= 0.03 on CUDA
(bfloat16; max <= 1.0 as a sanity bound) or <= 1e-4 on CPU (float32; max <= 1e-3), at both
temperatures, every
sample carries version 1, and before it the difference was larger than after (the update
really changed what vLLM serves). SKIP: no CUDA; vLLM not importable.

Placement: CPU: both in this process (vLLM inline), gloo. CUDA with 2+ GPUs: vLLM on cuda:0
(its own engine process), the trainer on cuda:1, NCCL. One GPU: both on it (vLLM takes 0.4 of
its memory) and gloo, as the RL loop chooses when a trainer and a server share a GPU (NCCL
refuses two ranks on one GPU: "Duplicate GPU detected"; see ``system.reshard.backend``).
``--sync-backend gloo`` forces gloo.

    python3 -m scripts.gpu_checks.vllm_sync [--device cuda|cpu] [--model .models/arith-tiny]
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Any

from scripts.gpu_checks.common import (Verdict, abs_diffs, base_parser, cuda_devices, device_skip,
                                       exit_code, model_skip, need, out, random_seqs, sft_loss)

CHECK = "vllm_sync"
CHECKS = (CHECK,)
TOLS = {"cuda": (0.03, 1.0), "cpu": (1e-4, 1e-3)}  # (mean, max) |log-prob difference|
PREFIX = "gpu-check-sync"
TEMPERATURE = 0.7
"""Also compared after the update: samples at this temperature, the trainer's log-probs at it."""


def placement(device: str, backend: str, n: int) -> tuple[str, str, float | None] | str:
    """``(trainer device, sync backend, vLLM memory fraction)`` with ``n`` visible GPUs, or
    why it cannot run here."""
    if device == "cpu":
        return "cpu", "gloo", None
    if n < 1:
        return "no GPU visible"
    if n == 1:  # one shared GPU: gloo (NCCL refuses two ranks on it); leave the trainer room
        return "cuda:0", "gloo", 0.4
    return "cuda:1", "gloo" if backend == "gloo" else "nccl", None


def sample(gen: Any, prompts: list[list[int]], n: int, max_tokens: int, seed: int,
           temperature: float = 1.0) -> list[tuple[list[int], dict[str, Any]]]:
    """``n`` samples of every prompt at ``temperature``, with vLLM's log-probs (those of the
    distribution sampled from)."""
    from workers.engines.vllm_server import Sampling

    futs = [(p, gen.submit(p, n, Sampling(max_tokens=max_tokens, temperature=temperature,
                                          ignore_eos=True, seed=seed + i)))
            for i, p in enumerate(prompts)]
    return [(p, s) for p, f in futs for s in f.result(timeout=300)]


def compare(trainer: Any, samples: list[tuple[list[int], dict[str, Any]]],
            temperature: float = 1.0) -> tuple[float, float]:
    """Mean and max |trainer log-prob - vLLM log-prob| over every sampled token, the trainer's
    at the temperature the tokens were sampled at."""
    import torch

    seqs = [torch.tensor(p + [int(t) for t in s["tokens"]]) for p, s in samples]
    temps = [torch.full((len(s["tokens"]),), temperature) for _, s in samples]
    mine = trainer.logprobs(seqs, temps if temperature != 1.0 else None)
    got = [lp[len(p) - 1:].float() for lp, (p, _) in zip(mine, samples)]
    want = [torch.from_numpy(s["logprobs"]).float() for _, s in samples]
    return abs_diffs(got, want)


def publish(gen: Any, trainer: Any, spec: Any, timeout: float) -> dict[str, Any]:
    """One weight update: the trainer (rank 0, hosting the group's store) sends its shards,
    the engine's worker receives them in place (``update_weights`` of a generation server)."""
    import torch.distributed as dist

    from workers.publish import send_shards, source_boxes

    host = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True,
                         wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
    address = f"127.0.0.1:{host.port}"
    joined = gen.control(lambda llm: llm.collective_rpc(
        "rlsys_weight_sync_init", args=(spec.to_wire(), 0, address, PREFIX)))
    executor = spec.executor(0, dist.PrefixStore(PREFIX, host), trainer.device)
    joined.result(timeout=timeout)
    boxes = source_boxes(spec, 0, trainer.local_shards())
    received = gen.control(lambda llm: llm.collective_rpc("rlsys_weight_sync_receive"),
                           version=1)
    t0 = time.perf_counter()
    sent: dict[str, int] = {}
    sender = threading.Thread(target=lambda: sent.update(
        bytes=send_shards(executor, trainer, boxes)), daemon=True)
    sender.start()
    report = received.result(timeout=timeout)[0]
    sender.join(timeout=timeout)
    return {**report, "wall_seconds": time.perf_counter() - t0, "bytes_sent": sent.get("bytes")}


def build(args: Any, trainer_device: str, mem: float | None) -> tuple[Any, Any]:
    """The vLLM engine (first: it sizes its cache from the memory it finds) and the trainer."""
    from workers.engines.configs import TorchEngineConfig
    from workers.engines.torch_engine import TorchEngine
    from workers.engines.vllm_server import GenerationEngine, VllmConfig

    gen = GenerationEngine(args.model, VllmConfig(max_model_len=args.max_model_len,
                                                  kv_cache_gib=args.kv_cache_gib,
                                                  gpu_memory_utilization=mem, seed=0))
    trainer = TorchEngine(TorchEngineConfig(model_path=args.model, lr=args.lr), trainer_device)
    return gen, trainer


def check(args: Any, trainer_device: str, backend: str, mem: float | None) -> Verdict:
    from transformers import AutoConfig

    from system.reshard.layout import GenLayout, TrainLayout
    from system.reshard.params import ModelShape
    from system.reshard.spec import WeightSyncSpec

    gen, trainer = build(args, trainer_device, mem)
    try:
        vocab = int(AutoConfig.from_pretrained(args.model).vocab_size)
        batch = random_seqs(32, 8, 24, vocab, seed=1)
        for _ in range(args.train_steps):  # new weights: vLLM still serves the checkpoint's
            trainer.train_step(batch, sft_loss, sum(len(s) - 1 for s in batch))
        prompts = [[int(t) for t in s] for s in random_seqs(args.prompts, 3, 8, vocab, seed=2)]
        dtype = str(trainer.dtype).replace("torch.", "")
        out("vllm_sync_placement", f"trainer {trainer_device} ({dtype} published, "
            f"{str(trainer.master_dtype).replace('torch.', '')} master), vLLM "
            f"{'cpu' if args.device == 'cpu' else 'cuda:0'}, {backend}")
        before = compare(trainer, sample(gen, prompts, args.n, args.max_tokens, seed=10))
        out("vllm_sync_before_mean_abs_diff", before[0])
        out("vllm_sync_before_max_abs_diff", before[1])
        spec = WeightSyncSpec(TrainLayout(dp=1), GenLayout(1, 1),
                              ModelShape.from_hf(AutoConfig.from_pretrained(args.model)),
                              dtype, backend, "fast", 64 << 20, args.timeout)
        report = publish(gen, trainer, spec, args.timeout)
        out("vllm_sync_update", f"{report.get('bytes_sent')} bytes in "
            f"{report['wall_seconds']:.3f}s (mode {report.get('mode')})")
        after_samples = sample(gen, prompts, args.n, args.max_tokens, seed=20)
        versions = {int(v) for _, s in after_samples for v in s["versions"]}
        after = compare(trainer, after_samples)
        out("vllm_sync_samples", f"{len(after_samples)} x {args.max_tokens} tokens, "
            f"versions {sorted(versions)}")
        out("vllm_sync_after_mean_abs_diff", after[0])
        out("vllm_sync_after_max_abs_diff", after[1])
        hot = compare(trainer, sample(gen, prompts, args.n, args.max_tokens, seed=40,
                                      temperature=TEMPERATURE), TEMPERATURE)
        out("vllm_sync_tempered_mean_abs_diff", hot[0])
        out("vllm_sync_tempered_max_abs_diff", hot[1])
    finally:
        gen.close()
    mean_tol, max_tol = TOLS[args.device]
    out("vllm_sync_tolerance", f"mean <= {mean_tol}, max <= {max_tol}")
    problems = []
    if after[0] > mean_tol or after[1] > max_tol:
        problems.append(f"after the update mean {after[0]:.3g} / max {after[1]:.3g}")
    if hot[0] > mean_tol or hot[1] > max_tol:
        problems.append(f"at temperature {TEMPERATURE} mean {hot[0]:.3g} / max {hot[1]:.3g}")
    if not before[0] > after[0]:
        problems.append(f"the update changed nothing (before {before[0]:.3g})")
    if versions != {1}:
        problems.append(f"samples carry versions {sorted(versions)}, not [1]")
    return Verdict(CHECK, "FAIL" if problems else "PASS", "; ".join(problems))


def run(args: Any) -> Verdict:
    why = (device_skip(args.device)
           or need("vllm", "workers.engines.vllm_server", "workers.publish")
           or model_skip(args.model))
    if why:
        return Verdict(CHECK, "SKIP", why)
    where = placement(args.device, args.sync_backend, cuda_devices())
    if isinstance(where, str):
        return Verdict(CHECK, "SKIP", where)
    try:
        return check(args, *where)
    except Exception as e:
        import traceback

        traceback.print_exc()
        return Verdict(CHECK, "FAIL", f"{type(e).__name__}: {e}".splitlines()[0])


def main() -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--sync-backend", choices=("auto", "gloo"), default="auto",
                    help="auto: gloo on CPU and on one shared GPU, NCCL between two GPUs")
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    v = run(args).show()
    return exit_code([v])


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the verdict is out and vLLM is closed: no wait on the teardown of the weight-sync
    # groups (NCCL communicators, a TCPStore) that nothing destroys, which can hang at exit
    os._exit(code)
