"""(d) A 30-step GRPO trial on SmolLM2 on the GPU(s), through the launcher.

Runs ``python -m system.launch exp=smollm2-arith trial=<T> rl.total_steps=30 ...`` (on one GPU
the model worker and the generation server share it: ``scheduler.local.share_gpus=true`` and
``rl.vllm.gpu_memory_utilization=0.4``) and reads the trial's ``summary.json``. PASS: the
launcher exits 0, the status is ``completed`` and the trial ran every step; the reward of the
first and last three steps is printed (``reward_first3`` / ``reward_last3``). SKIP: no CUDA; vLLM
or the launcher's packages not importable; no model. ``--device cpu`` runs ``arith-tiny``
instead (CI covers that run elsewhere; :func:`launch_args` and :func:`judge` are pure and tested).

    python3 -m scripts.gpu_checks.grpo [--device cuda|cpu] [--steps 30] [--fileroot runs/gpu-check]
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Any

from scripts.gpu_checks.common import (ROOT, Verdict, cuda_devices, device_skip, exit_code,
                                       kill_group, model_skip, need, out, start_group)

CHECK = "grpo"
CHECKS = (CHECK,)
EXPS = {"cuda": ("smollm2-arith", os.path.join(ROOT, ".models", "smollm2-135m-instruct")),
        "cpu": ("arith-tiny", os.path.join(ROOT, ".models", "arith-tiny"))}


def launch_args(exp: str, trial: str, fileroot: str, steps: int, gpus: int,
                timeout: float = 1500) -> list[str]:
    """The launcher's arguments: ``gpus`` visible GPUs (0: the CPU run); the trial stops
    itself (every worker) ``timeout`` seconds after it started."""
    args = ["-m", "system.launch", f"exp={exp}", f"trial={trial}", f"rl.total_steps={steps}",
            f"cluster.fileroot={fileroot}", "recover=off", f"controller.timeout={timeout:.0f}"]
    if gpus == 1:  # one model worker and one generation server on one GPU; a fixed KV cache:
        # vLLM does not size it by profiling free memory while the trainer starts beside it
        args += ["scheduler.local.share_gpus=true", "rl.vllm.gpu_memory_utilization=0.4",
                 "rl.vllm.kv_cache_gib=4"]
    elif gpus == 0:
        args += ["scheduler.local.gpus=none"]
    return args


def judge(summary: dict[str, Any] | None, rc: int, steps: int) -> Verdict:
    """The verdict on a finished trial (``summary`` is its ``summary.json``, or ``None``)."""
    if summary is None:
        return Verdict(CHECK, "FAIL", f"the launcher exited {rc} and wrote no summary.json")
    status = summary.get("status")
    if rc != 0 or status != "completed":
        return Verdict(CHECK, "FAIL", f"the launcher exited {rc}, status {status}")
    done = summary.get("steps")
    if done != steps:
        return Verdict(CHECK, "FAIL", f"the trial ran {done} steps, not {steps}")
    rewards = [summary.get("reward_first3"), summary.get("reward_last3")]
    if not all(isinstance(r, (int, float)) and math.isfinite(r) for r in rewards):
        return Verdict(CHECK, "FAIL", f"rewards are not numbers: {rewards}")
    return Verdict(CHECK, "PASS")


def run(device: str, steps: int, fileroot: str, timeout: float) -> Verdict:
    exp, model = EXPS[device]
    why = (device_skip(device) or need("vllm", "zmq", "msgpack", "system.launch")
           or model_skip(model))
    if why:
        return Verdict(CHECK, "SKIP", why)
    trial = time.strftime("gpu-check-%Y%m%d-%H%M%S")
    gpus = cuda_devices() if device == "cuda" else 0
    cmd = [sys.executable, *launch_args(exp, trial, fileroot, steps, gpus, timeout)]
    out("grpo_command", " ".join(cmd[1:]))
    t0 = time.monotonic()
    launcher = start_group(cmd, subprocess.DEVNULL)
    try:  # (controller.timeout stops the trial first; this is the backstop)
        rc = launcher.wait(timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        launcher.terminate()  # the launcher stops every worker on SIGTERM
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        return Verdict(CHECK, "FAIL", f"the trial ran past {timeout:.0f}s")
    finally:
        kill_group(launcher.pid)
        launcher.wait()
    path = os.path.join(fileroot, exp, trial, "summary.json")
    summary = None
    if os.path.isfile(path):
        with open(path) as f:
            summary = json.load(f)
        out("grpo_trial_dir", os.path.dirname(path))
        for k in ("status", "steps", "reward_first3", "reward_last3", "eval_accuracy_before",
                  "eval_accuracy_after", "loop_seconds"):
            out(f"grpo_{k}", summary.get(k))
    out("grpo_wall_s", time.monotonic() - t0)
    return judge(summary, rc, steps)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--fileroot", default=os.path.join(ROOT, "runs", "gpu-check"))
    ap.add_argument("--timeout", type=float, default=1500)
    args = ap.parse_args()
    v = run(args.device, args.steps, os.path.abspath(args.fileroot), args.timeout).show()
    return exit_code([v])


if __name__ == "__main__":
    sys.exit(main())
