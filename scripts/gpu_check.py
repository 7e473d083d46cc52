#!/usr/bin/env python3
"""GPU checks of the torch training engine (``workers/engines/torch_engine.py``) on ``cuda:0``.

The engine part of ``make gpu-check`` (``python3 -m scripts.gpu_checks`` runs it and the
rest). Prints ``name: value`` lines and ends with ``gpu_check: PASS`` or ``gpu_check: FAIL (<checks>)``:

- parity: per-token log-probs of the engine on CUDA (bfloat16 compute over float32 master
  weights with ``dtype=auto``; and float32, which isolates the precision from the
  padding/micro-batching path) against a float32 Hugging Face forward of each sequence alone
  (TF32 off);
- training: 20 steps of a token-mean NLL (lr 1e-3, as in the tests) lower the loss;
- checkpoint: ``save``, then a fresh engine from the checkpoint plus ``load_optimizer``
  (``torch.load(weights_only=True)``): identical log-probs, master weights, optimizer state
  (AdamW's ``step`` on the same device) and step count, and the same next step (the loss
  identical, the weights within ``NEXT_STEP_TOL``: CUDA's backward is not bitwise
  deterministic, which float32 master weights show);
- update at the configured lrs: one AdamW step at the lrs the experiments use (arith-tiny's
  actor 5e-4, the PPO critic 1e-4, ``TorchEngineConfig``'s default 1e-5, smollm2-arith's actor
  2e-6) changes at least half the engine's parameter elements (the float32 master weights of
  the mixed-precision engine; bfloat16 parameters would lose an update far below their
  rounding step); the fraction of the published bfloat16 weights changed is printed too;
- fsdp_mixed: the sharded (FSDP2) engine on a one-rank NCCL group: float32 DTensor master
  weights and AdamW state, bfloat16 compute through ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` (log-prob parity as above, and not the float32 result), one step at
  smollm2-arith's lr 2e-6 changes at least half the master elements, and the publish sends
  float32 local shards that the executor casts to bfloat16 bucket by bucket;
- nccl_groups: the weight-update groups' NCCL calls on one rank (``GroupFactory``'s
  communicator broadcasts on a stream of its own, as ``ReshardExecutor.run`` does; its
  ``abort()``, which ``ReshardExecutor.abort`` calls, returns);
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

from scripts.gpu_checks.common import (Verdict, abs_diffs, model_skip, out,  # noqa: E402
                                       random_seqs, reference_logprobs, sft_loss)

MEAN_BF16_TOL = 0.03   # mean |log-prob difference|, bfloat16 engine vs float32 reference
MAX_BF16_TOL = 0.25    # worst token, bfloat16 (a sanity bound: padding or masking bugs show here)
MAX_FP32_TOL = 1e-4    # worst token, float32 engine on CUDA vs the same reference
# next step of a restored engine vs the original's, float32 master weights: CUDA's backward is
# not bitwise deterministic (SDPA's memory-efficient attention accumulates with atomics), so
# they may differ by a float32 rounding step (~2e-9 at |w| ~ 0.02); a resume that lost the
# float32 masters (a bfloat16 rounding step there: ~1e-4) or the AdamW state (~1e-3) does not
NEXT_STEP_TOL = 1e-6
UPDATE_FRAC_MIN = 0.5  # fraction of parameter elements one default-lr AdamW step must change


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


class Checks:
    """The checks on ``cuda:0``, sharing the model, its vocabulary and the parity sequences; a
    failed one is named in :attr:`failed`."""

    def __init__(self, torch, args, vocab: int) -> None:
        from workers.engines.torch_engine import TorchEngine, TorchEngineConfig

        self.torch, self.args, self.vocab, self.dev = torch, args, vocab, "cuda:0"
        self.engine_api = (TorchEngine, TorchEngineConfig)
        self.failed: list[str] = []
        self.state: dict = {}
        torch.manual_seed(0)
        # parity set: lengths up to max_model_len (128) so padding and several micro-batches
        self.seqs = random_seqs(32, 5, 128, vocab, seed=0)

    def check(self, name: str, ok: bool) -> None:
        out(f"{name}_ok", ok)
        if not ok:
            self.failed.append(name)

    def guarded(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # report, go on with the other checks
            traceback.print_exc()
            out(f"{name}_error", f"{type(e).__name__}: {e}".splitlines()[0])
            self.failed.append(name)

    def parity(self) -> None:
        torch, args, dev, seqs = self.torch, self.args, self.dev, self.seqs
        TorchEngine, TorchEngineConfig = self.engine_api
        want = reference_logprobs(args.model, seqs, dev)
        eng = TorchEngine(TorchEngineConfig(model_path=args.model), dev)
        out("engine_dtype_cuda", str(eng.dtype).replace("torch.", ""))
        out("engine_master_dtype_cuda", str(eng.master_dtype).replace("torch.", ""))
        out("engine_param_dtypes_cuda",
            sorted({str(p.dtype).replace("torch.", "") for p in eng.model.parameters()}))
        got = eng.logprobs(seqs)
        on_cpu = all(g.device.type == "cpu" and g.shape == w.shape for g, w in zip(got, want))
        mean, mx = abs_diffs(got, want)
        out("parity_bf16_mean_abs_diff", mean)
        out("parity_bf16_max_abs_diff", mx)
        self.check("parity_bf16", on_cpu and mean <= MEAN_BF16_TOL and mx <= MAX_BF16_TOL)
        del eng
        eng = TorchEngine(TorchEngineConfig(model_path=args.model, dtype="float32",
                                            max_tokens_per_microbatch=512), dev)
        mean, mx = abs_diffs(eng.logprobs(seqs), want)
        out("parity_fp32_mean_abs_diff", mean)
        out("parity_fp32_max_abs_diff", mx)
        self.check("parity_fp32", mx <= MAX_FP32_TOL)

    def training(self) -> None:
        args, dev, seqs = self.args, self.dev, self.seqs
        TorchEngine, TorchEngineConfig = self.engine_api
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
        self.check("train", finite and losses[-1] < 0.9 * losses[0])
        self.state["trained"] = eng

    def checkpoint(self) -> None:
        torch, dev, seqs = self.torch, self.dev, self.seqs
        TorchEngine, TorchEngineConfig = self.engine_api
        eng = self.state.get("trained")
        if eng is None:
            raise RuntimeError("no trained engine (the training check failed)")
        before = eng.logprobs(seqs)
        with tempfile.TemporaryDirectory(prefix="gpu-check-ckpt-") as d:
            eng.save(d, 0)
            blob = torch.load(os.path.join(d, "optimizer.rank0.pt"), weights_only=True)
            back = TorchEngine(TorchEngineConfig(model_path=d, lr=1e-3), dev)
            back.load_optimizer(d, 0)
        after = back.logprobs(seqs)
        _, mx = abs_diffs(after, before)
        out("ckpt_logprob_max_abs_diff", mx)
        out("ckpt_dtype", f"{back.dtype} published, {back.master_dtype} master")
        sd_w = eng.full_state_dict()
        sd_g = back.full_state_dict()
        w_same = sd_w.keys() == sd_g.keys() and all(torch.equal(sd_w[k], sd_g[k]) for k in sd_w)
        mw, mg = dict(eng.model.named_parameters()), dict(back.model.named_parameters())
        w_same = w_same and mw.keys() == mg.keys() and all(
            mg[k].dtype == mw[k].dtype and torch.equal(mg[k], mw[k]) for k in mw)
        want, got = eng.optimizer.state_dict(), back.optimizer.state_dict()
        # compared on the CPU; the devices are checked apart (AdamW keeps a non-capturable
        # ``step`` on the CPU, and so does load_optimizer)
        opt_same = want["param_groups"] == got["param_groups"] and all(
            torch.equal(got["state"][i][k].cpu(), v.cpu()) for i, st in want["state"].items()
            for k, v in st.items())
        step_dev = {str(st["step"].device) for st in got["state"].values()}
        opt_same = opt_same and step_dev == {str(st["step"].device)
                                             for st in want["state"].values()}
        out("ckpt_weights_equal", w_same)
        out("ckpt_optimizer_equal", opt_same)
        out("ckpt_optimizer_step_device", f"restored {sorted(step_dev)}, trained "
            f"{sorted({str(st['step'].device) for st in want['state'].values()})}")
        out("ckpt_steps", f"{back.steps} (saved {blob['steps']}, trained {eng.steps})")
        steps_same = back.steps == eng.steps == blob["steps"]
        # the next step of the restored engine equals the original's (within NEXT_STEP_TOL)
        tokens = sum(len(s) - 1 for s in seqs)
        la = eng.train_step(seqs, sft_loss, tokens)["loss"]
        lb = back.train_step(seqs, sft_loss, tokens)["loss"]
        sd_w, sd_g = eng.full_state_dict(), back.full_state_dict()
        nxt = max(float((sd_w[k].float() - sd_g[k].float()).abs().max()) for k in sd_w)
        nxt = max([nxt] + [float((p - mg[k]).detach().abs().max()) for k, p in mw.items()])
        out("ckpt_next_step_loss", f"{la:.6g} original, {lb:.6g} restored")
        out("ckpt_next_step_weight_max_abs_diff", nxt)
        self.check("ckpt", mx == 0.0 and w_same and opt_same and steps_same and la == lb
                   and nxt <= NEXT_STEP_TOL)
        del self.state["trained"]

    def default_lr_update(self) -> None:
        torch, args, dev, vocab = self.torch, self.args, self.dev, self.vocab
        TorchEngine, TorchEngineConfig = self.engine_api
        """Mixed precision (dtype=auto on CUDA): float32 master weights and AdamW state, so an
        update (about lr per element) far below bfloat16's rounding step (2**-14 for |w| in
        [1/64, 1/32), 2**-8 for RMSNorm's 1.0) is kept and accumulates. Checked on the engine's
        parameters (the masters); the published (bfloat16) weights are printed alongside: they
        change once the accumulated update crosses a rounding step."""
        batch = random_seqs(128, 6, 10, vocab, seed=1)
        tokens = sum(len(s) - 1 for s in batch)
        lrs = [("arith_tiny_actor", 5e-4), ("critic", 1e-4),
               ("engine_default", TorchEngineConfig.lr), ("smollm2_actor", 2e-6)]
        ok, fixed = True, []
        for dtype in ("auto", "float32"):
            for label, lr in lrs:
                if dtype == "float32" and label != "engine_default":
                    continue
                eng = TorchEngine(TorchEngineConfig(model_path=args.model, lr=lr,
                                                    dtype=dtype), dev)
                name = f"{dtype}_{str(eng.master_dtype).replace('torch.', '')}"
                p0 = [p.detach().clone() for p in eng.model.parameters()]
                pub0 = {k: v.clone() for k, v in eng.full_state_dict().items()}
                total = sum(q.numel() for q in p0)
                n_steps = 20 if label in ("engine_default", "smollm2_actor") else 1
                for k in range(n_steps):
                    eng.train_step(batch, sft_loss, tokens)
                    if k in (0, n_steps - 1):
                        changed = sum(int((p.detach() != q).sum())
                                      for p, q in zip(eng.model.parameters(), p0))
                        out(f"update_{name}_lr{lr:g}_{label}_changed_frac_after_{k + 1}",
                            changed / total)
                        if k == 0:
                            ok = ok and changed / total >= UPDATE_FRAC_MIN
                            if dtype == "auto" and lr <= TorchEngineConfig.lr:
                                fixed.append(f"lr {lr:g}: {changed / total:.4f}")
                pub = eng.full_state_dict()
                out(f"update_{name}_lr{lr:g}_{label}_published_"
                    f"{str(eng.dtype).replace('torch.', '')}_changed_frac_after_{n_steps}",
                    sum(int((pub[n] != pub0[n]).sum()) for n in pub) / total)
                del eng, p0, pub0, pub
        # the engine as configured (dtype=auto: float32 masters, bfloat16 compute on CUDA);
        # with bfloat16 parameters one step changed 15.6% (lr 1e-5) and 4% (lr 2e-6)
        out("update_fixed_engine_changed_frac_after_1", ", ".join(fixed))
        self.check("default_lr_update", ok)

    def fsdp_mixed(self) -> None:
        """The FSDP2 code path of the engine (``fsdp=True``) on a one-rank NCCL group."""
        import socket

        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        torch, args, dev, seqs = self.torch, self.args, self.dev, self.seqs
        TorchEngine, TorchEngineConfig = self.engine_api
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        try:
            eng = TorchEngine(TorchEngineConfig(model_path=args.model, lr=2e-6), dev, fsdp=True)
            params = list(eng.model.parameters())
            masters = all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params)
            out("fsdp_mixed_masters_fp32_dtensor", masters)
            want = reference_logprobs(args.model, seqs, dev)
            mean, mx = abs_diffs(eng.logprobs(seqs), want)
            out("fsdp_mixed_parity_bf16_mean_abs_diff", mean)
            out("fsdp_mixed_parity_bf16_max_abs_diff", mx)
            batch = random_seqs(128, 6, 10, self.vocab, seed=1)
            p0 = [p.detach().to_local().clone() for p in params]
            eng.train_step(batch, sft_loss, sum(len(s) - 1 for s in batch))
            changed = sum(int((p.detach().to_local() != q).sum()) for p, q in zip(params, p0))
            frac = changed / sum(q.numel() for q in p0)
            out("fsdp_mixed_lr2e-6_changed_frac_after_1", frac)
            state = all(v.dtype == torch.float32 for p in params
                        for k, v in eng.optimizer.state[p].items() if k != "step")
            out("fsdp_mixed_adamw_state_fp32", state)
            shards = eng.local_shards()
            publish = (eng.dtype == torch.bfloat16
                       and all(t.dtype == torch.float32 for t in shards.values()))
            out("fsdp_mixed_publish", f"{str(eng.dtype).replace('torch.', '')} from float32 "
                f"shards: {publish}")
            # bfloat16 compute shows as a difference from the float32 reference (parity_fp32
            # is within 1e-4 at worst); none at all would mean the policy was not applied
            self.check("fsdp_mixed", masters and state and publish and frac >= UPDATE_FRAC_MIN
                       and 1e-4 < mean <= MEAN_BF16_TOL and mx <= MAX_BF16_TOL)
        finally:
            dist.destroy_process_group()

    def nccl_groups(self) -> None:
        """The weight-update groups' NCCL calls on one rank (two ranks need two GPUs): a
        ``GroupFactory`` communicator broadcasts on a stream of its own, as
        ``ReshardExecutor.run`` does, and ``abort()``, which ``ReshardExecutor.abort`` calls when
        a generation server is given up, returns at once on this torch."""
        import torch.distributed as dist

        from system.reshard.executor import GroupFactory

        torch, dev = self.torch, self.dev
        torch.cuda.set_device(dev)
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        pg = GroupFactory(store, 0, backend="nccl", timeout=60).get((0,))
        x = torch.full((1 << 22,), 3.0, device=dev)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([x], opts).wait()
        stream.synchronize()
        sent = bool((x == 3.0).all())  # (one rank: the call completing is what is checked)
        out("nccl_groups_side_stream_broadcast_completes", sent)
        t0 = time.monotonic()
        pg.abort()
        took = time.monotonic() - t0
        out("nccl_groups_abort_s", took)
        self.check("nccl_groups", sent and took < 10)

    def timing(self) -> None:
        torch, args, dev, vocab = self.torch, self.args, self.dev, self.vocab
        TorchEngine, TorchEngineConfig = self.engine_api
        batches = {
            # arith-tiny's step: batch_size 16 x group_size 8, prompt "a+b=" + bos + <= 4 tokens
            "rl_batch": random_seqs(128, 6, 10, vocab, seed=2),
            # the same count at max_model_len (128): what a longer task would train on
            "long_batch": random_seqs(128, 128, 128, vocab, seed=3),
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
    why = model_skip(args.model)
    if why:  # a SKIP like the other parts' (make setup builds .models/arith-tiny)
        Verdict("gpu_check", "SKIP", why).show()
        return 2

    import transformers

    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    out("device", torch.cuda.get_device_name(0))
    out("torch", torch.__version__)
    out("transformers", transformers.__version__)
    out("model", os.path.relpath(args.model, ROOT))
    out("cpu_threads", torch.get_num_threads())
    checks = Checks(torch, args, vocab)
    for name, fn in (("parity", checks.parity), ("train", checks.training),
                     ("ckpt", checks.checkpoint), ("default_lr_update", checks.default_lr_update),
                     ("fsdp_mixed", checks.fsdp_mixed), ("nccl_groups", checks.nccl_groups),
                     ("timing", checks.timing)):
        checks.guarded(name, fn)
    failed = checks.failed
    print(f"gpu_check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
