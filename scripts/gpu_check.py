#!/usr/bin/env python3
"""GPU checks of the torch training engine (``workers/engines/torch_engine.py``) on ``cuda:0``.

The first half of ``make gpu-check`` (the rest needs vLLM and Megatron). Prints ``name: value``
lines and ends with ``gpu_check: PASS`` or ``gpu_check: FAIL (<checks>)``:

- parity: per-token log-probs of the engine on CUDA (bfloat16 with ``dtype=auto``; and float32,
  which isolates the precision from the padding/micro-batching path) against a float32 Hugging
  Face forward of each sequence alone (TF32 off);
- training: 20 steps of a token-mean NLL (lr 1e-3, as in the tests) lower the loss;
- checkpoint: ``save``, then a fresh engine from the checkpoint plus ``load_optimizer``
  (``torch.load(weights_only=True)``): identical log-probs, optimizer state and step count;
- update at the configured lrs: an AdamW step at the lrs the experiments use (arith-tiny's
  actor 5e-4, the PPO critic 1e-4, ``TorchEngineConfig``'s default 1e-5, smollm2-arith's actor
  2e-6) changes at least half the parameter elements (bfloat16 parameters lose an update far
  below their rounding step);
- timing: train-step tokens/s on arith-tiny's RL batch (batch_size 16 x group_size 8 short
  sequences) and on a full-length batch (128 x max_model_len 128), CUDA against the CPU engine
  (float32) in the same run, with the peak GPU memory.

Exit status: 0 all checks pass, 1 a check failed, 2 no CUDA device (nothing checked).
Imports only what the engine needs (torch, transformers, safetensors): no vLLM, no pyzmq.

    python3 scripts/gpu_check.py [--model .models/arith-tiny] [--steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MEAN_BF16_TOL = 0.03   # mean |log-prob difference|, bfloat16 engine vs float32 reference
MAX_BF16_TOL = 0.25    # worst token, bfloat16 (a sanity bound: padding or masking bugs show here)
MAX_FP32_TOL = 1e-4    # worst token, float32 engine on CUDA vs the same reference
UPDATE_FRAC_MIN = 0.5  # fraction of parameter elements one default-lr AdamW step must change


def out(name: str, value) -> None:
    if isinstance(value, float):
        value = f"{value:.6g}"
    print(f"{name}: {value}", flush=True)


def sft_loss(lps, idx):  # negative log-likelihood, summed over tokens (as in the tests)
    return -sum(lp.sum() for lp in lps)


def make_seqs(torch, n: int, lo: int, hi: int, vocab: int, seed: int):
    """``n`` random sequences of lengths in [lo, hi] over the non-special ids (3..vocab-1)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g) for k in lens]


def reference_logprobs(torch, model_dir: str, seqs, device: str):
    """Float32 Hugging Face forward of each sequence alone (no padding), TF32 off."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               local_files_only=True).to(device).eval()
    want = []
    with torch.no_grad():
        for s in seqs:
            s = s.to(device)
            logits = ref(s[None]).logits[0].float()
            want.append(torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0].cpu())
    del ref
    return want


def diffs(torch, got, want):
    d = torch.cat([(g.float() - w.float()).abs() for g, w in zip(got, want)])
    return float(d.mean()), float(d.max())


def time_train(torch, eng, seqs, steps: int, warmup: int, cuda: bool) -> float:
    """Seconds per ``train_step`` on ``seqs`` (after ``warmup`` steps)."""
    tokens = sum(len(s) - 1 for s in seqs)
    for _ in range(warmup):
        eng.train_step(seqs, sft_loss, tokens)
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.train_step(seqs, sft_loss, tokens)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, ".models", "arith-tiny"))
    ap.add_argument("--steps", type=int, default=20, help="training steps of the loss check")
    ap.add_argument("--timing-steps", type=int, default=10)
    args = ap.parse_args()

    try:
        import torch
    except ImportError as e:
        print(f"gpu_check: torch is not importable ({e}); run `make setup` first", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}): the GPU checks need one, nothing was checked",
              file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        print(f"gpu_check: no model at {args.model} (make setup builds .models/arith-tiny)",
              file=sys.stderr)
        return 1

    import transformers

    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    from workers.engines.torch_engine import TorchEngine, TorchEngineConfig

    dev = "cuda:0"
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    out("device", torch.cuda.get_device_name(0))
    out("torch", torch.__version__)
    out("transformers", transformers.__version__)
    out("model", os.path.relpath(args.model, ROOT))
    out("cpu_threads", torch.get_num_threads())
    failed: list[str] = []

    def check(name: str, ok: bool) -> None:
        out(f"{name}_ok", ok)
        if not ok:
            failed.append(name)

    def guarded(name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # report, go on with the other checks
            traceback.print_exc()
            out(f"{name}_error", f"{type(e).__name__}: {e}".splitlines()[0])
            failed.append(name)

    torch.manual_seed(0)
    # parity set: lengths up to max_model_len (128) so padding and several micro-batches occur
    seqs = make_seqs(torch, 32, 5, 128, vocab, seed=0)
    state: dict = {}

    def parity() -> None:
        want = reference_logprobs(torch, args.model, seqs, dev)
        eng = TorchEngine(TorchEngineConfig(model_path=args.model), dev)
        out("engine_dtype_cuda", str(eng.dtype).replace("torch.", ""))
        got = eng.logprobs(seqs)
        on_cpu = all(g.device.type == "cpu" and g.shape == w.shape for g, w in zip(got, want))
        mean, mx = diffs(torch, got, want)
        out("parity_bf16_mean_abs_diff", mean)
        out("parity_bf16_max_abs_diff", mx)
        check("parity_bf16", on_cpu and mean <= MEAN_BF16_TOL and mx <= MAX_BF16_TOL)
        del eng
        eng = TorchEngine(TorchEngineConfig(model_path=args.model, dtype="float32",
                                            max_tokens_per_microbatch=512), dev)
        mean, mx = diffs(torch, eng.logprobs(seqs), want)
        out("parity_fp32_mean_abs_diff", mean)
        out("parity_fp32_max_abs_diff", mx)
        check("parity_fp32", mx <= MAX_FP32_TOL)

    def training() -> None:
        eng = TorchEngine(TorchEngineConfig(model_path=args.model, lr=1e-3), dev)
        tokens = sum(len(s) - 1 for s in seqs)
        losses, norms = [], []
        for _ in range(args.steps):
            st = eng.train_step(seqs, sft_loss, tokens)
            losses.append(st["loss"])
            norms.append(st["grad_norm"])
        out("train_steps", args.steps)
        out("train_loss_first", losses[0])
        out("train_loss_last", losses[-1])
        finite = all(map(lambda x: x == x and abs(x) < float("inf"), losses + norms))
        check("train", finite and losses[-1] < 0.9 * losses[0])
        state["trained"] = eng

    def checkpoint() -> None:
        eng = state.get("trained")
        if eng is None:
            raise RuntimeError("no trained engine (the training check failed)")
        before = eng.logprobs(seqs)
        with tempfile.TemporaryDirectory(prefix="gpu-check-ckpt-") as d:
            eng.save(d, 0)
            blob = torch.load(os.path.join(d, "optimizer.rank0.pt"), weights_only=True)
            back = TorchEngine(TorchEngineConfig(model_path=d, lr=1e-3), dev)
            back.load_optimizer(d, 0)
        after = back.logprobs(seqs)
        _, mx = diffs(torch, after, before)
        out("ckpt_logprob_max_abs_diff", mx)
        out("ckpt_dtype", str(back.dtype).replace("torch.", ""))
        sd_w = eng.full_state_dict()
        sd_g = back.full_state_dict()
        w_same = sd_w.keys() == sd_g.keys() and all(torch.equal(sd_w[k], sd_g[k]) for k in sd_w)
        want, got = eng.optimizer.state_dict(), back.optimizer.state_dict()
        # compared on the CPU: AdamW keeps a non-capturable ``step`` on the CPU, while
        # load_optimizer's map_location puts the restored one on the parameters' device
        opt_same = want["param_groups"] == got["param_groups"] and all(
            torch.equal(got["state"][i][k].cpu(), v.cpu()) for i, st in want["state"].items()
            for k, v in st.items())
        step_dev = {str(st["step"].device) for st in got["state"].values()}
        out("ckpt_weights_equal", w_same)
        out("ckpt_optimizer_equal", opt_same)
        out("ckpt_optimizer_step_device", f"restored {sorted(step_dev)}, trained "
            f"{sorted({str(st['step'].device) for st in want['state'].values()})}")
        out("ckpt_steps", f"{back.steps} (saved {blob['steps']}, trained {eng.steps})")
        steps_same = back.steps == eng.steps == blob["steps"]
        # the next step of the restored engine equals the next step of the original one
        tokens = sum(len(s) - 1 for s in seqs)
        la = eng.train_step(seqs, sft_loss, tokens)["loss"]
        lb = back.train_step(seqs, sft_loss, tokens)["loss"]
        sd_w, sd_g = eng.full_state_dict(), back.full_state_dict()
        nxt = max(float((sd_w[k].float() - sd_g[k].float()).abs().max()) for k in sd_w)
        out("ckpt_next_step_loss", f"{la:.6g} original, {lb:.6g} restored")
        out("ckpt_next_step_weight_max_abs_diff", nxt)
        check("ckpt", mx == 0.0 and w_same and opt_same and steps_same and la == lb
              and nxt == 0.0)
        del state["trained"]

    def default_lr_update() -> None:
        """bfloat16 parameters (dtype=auto on CUDA) under AdamW: an update (about lr per
        element) below half the rounding step of a weight (2**-14 for |w| in [1/64, 1/32),
        2**-8 for RMSNorm's 1.0) is lost, at every step alike."""
        batch = make_seqs(torch, 128, 6, 10, vocab, seed=1)
        tokens = sum(len(s) - 1 for s in batch)
        lrs = [("arith_tiny_actor", 5e-4), ("critic", 1e-4),
               ("engine_default", TorchEngineConfig.lr), ("smollm2_actor", 2e-6)]
        ok = True
        for dtype in ("auto", "float32"):
            for label, lr in lrs:
                if dtype == "float32" and label != "engine_default":
                    continue
                eng = TorchEngine(TorchEngineConfig(model_path=args.model, lr=lr,
                                                    dtype=dtype), dev)
                name = str(eng.dtype).replace("torch.", "")
                p0 = [p.detach().clone() for p in eng.model.parameters()]
                total = sum(q.numel() for q in p0)
                n_steps = 20 if label == "engine_default" else 1
                for k in range(n_steps):
                    eng.train_step(batch, sft_loss, tokens)
                    if k in (0, n_steps - 1):
                        changed = sum(int((p.detach() != q).sum())
                                      for p, q in zip(eng.model.parameters(), p0))
                        out(f"update_{name}_lr{lr:g}_{label}_changed_frac_after_{k + 1}",
                            changed / total)
                ok = ok and changed / total >= UPDATE_FRAC_MIN
                del eng, p0
        check("default_lr_update", ok)

    def timing() -> None:
        batches = {
            # arith-tiny's step: batch_size 16 x group_size 8, prompt "a+b=" + bos + <= 4 tokens
            "rl_batch": make_seqs(torch, 128, 6, 10, vocab, seed=2),
            # the same count at max_model_len (128): what a longer task would train on
            "long_batch": make_seqs(torch, 128, 128, 128, vocab, seed=3),
        }
        for name, batch in batches.items():
            ntok = sum(len(s) for s in batch)
            out(f"timing_{name}_seqs_tokens", f"{len(batch)} seqs, {ntok} tokens")
            res = {}
            for where in (dev, "cpu"):
                eng = TorchEngine(TorchEngineConfig(model_path=args.model), where)
                cuda = where != "cpu"
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                steps = args.timing_steps if cuda else max(2, args.timing_steps // 2)
                res[where] = time_train(torch, eng, batch, steps, warmup=2, cuda=cuda)
                tag = "cuda" if cuda else "cpu"
                out(f"timing_{name}_{tag}_step_ms", 1e3 * res[where])
                out(f"timing_{name}_{tag}_tok_per_s", ntok / res[where])
                if cuda:
                    out(f"timing_{name}_peak_gpu_mem_mib",
                        torch.cuda.max_memory_allocated() / 2**20)
                del eng
                if cuda:
                    torch.cuda.empty_cache()
            out(f"timing_{name}_cuda_over_cpu", res["cpu"] / res[dev])

    guarded("parity", parity)
    guarded("train", training)
    guarded("ckpt", checkpoint)
    guarded("default_lr_update", default_lr_update)
    guarded("timing", timing)
    print(f"gpu_check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
