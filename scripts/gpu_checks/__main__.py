"""``make gpu-check``: every GPU check of issue 13, one overall verdict.

    python3 -m scripts.gpu_checks [--device cuda|cpu] [--only engine,vllm_sync] [--skip grpo]

Parts, each run as its own process (so NCCL, vLLM and megatron state never mix) and each
printing ``name: value`` lines and one verdict line per check (PASS, FAIL or SKIP with one line
naming why):

- ``engine``: ``scripts/gpu_check.py``, the torch engine on cuda:0 (parity, training,
  checkpoint, update at the configured lrs, FSDP2 mixed precision, timing); CUDA only;
- ``reshard_bench`` (a): ``tests/benchmarks/reshard.py`` over NCCL, fraction of the link;
- ``vllm_sync`` (b): trainer -> real vLLM weight sync, log-prob parity of sampled tokens;
- ``megatron_tp`` (c): megatron tp=1 against HF float32, tp=2 against tp=1;
- ``grpo`` (d): a 30-step GRPO trial of smollm2-arith through the launcher;
- ``placement`` (e): the local scheduler's GPU list and each GPU's identity as the weight-sync
  backend choice reads it, against ``nvidia-smi``; CUDA only.

Exit status: 0 every check that could run passed, 1 a check failed, 2 nothing could run (no CUDA
device, or every check skipped). Needs only torch, transformers and safetensors to run at all:
what needs more says SKIP. ``--device cpu`` runs the CPU twins (gloo, float32).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from scripts.gpu_checks import grpo, megatron_tp, placement, reshard_bench, vllm_sync
from scripts.gpu_checks.common import ROOT, Verdict, device_skip, parse_verdicts, run_group


@dataclasses.dataclass(frozen=True)
class Part:
    """One part: the command after the interpreter, and the checks its verdict lines name."""

    name: str
    argv: tuple[str, ...]
    checks: tuple[str, ...]
    cuda_only: bool = False


PARTS = (
    Part("engine", (os.path.join(ROOT, "scripts", "gpu_check.py"),), ("gpu_check",), True),
    Part("reshard_bench", ("-m", "scripts.gpu_checks.reshard_bench"), reshard_bench.CHECKS),
    Part("vllm_sync", ("-m", "scripts.gpu_checks.vllm_sync"), vllm_sync.CHECKS),
    Part("megatron_tp", ("-m", "scripts.gpu_checks.megatron_tp"), megatron_tp.CHECKS),
    Part("grpo", ("-m", "scripts.gpu_checks.grpo"), grpo.CHECKS),
    Part("placement", ("-m", "scripts.gpu_checks.placement"), placement.CHECKS, True),
)


def select(only: str, skip: str) -> list[Part]:
    names = {p.name for p in PARTS}
    wanted = [s for s in (only + "," + skip).split(",") if s]
    unknown = sorted(set(wanted) - names)
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; valid: {sorted(names)}")
    keep = set(only.split(",")) if only else names
    return [p for p in PARTS if p.name in keep and p.name not in skip.split(",")]


def run_part(part: Part, device: str, timeout: float) -> list[Verdict]:
    """Run ``part`` (its output passes through) and read its verdicts; a check without one
    (the part crashed or hung) fails."""
    if part.cuda_only and device == "cpu":
        return [Verdict(c, "SKIP", "CUDA only (its CPU counterparts are the engine tests)")
                for c in part.checks]
    argv = [sys.executable, *part.argv] + ([] if part.cuda_only else ["--device", device])
    print(f"== {part.name}: {' '.join(argv[1:])}", flush=True)
    # the part's own deadlines are below ours; this one is a backstop that kills its group
    rc, output = run_group(argv, timeout, echo=True)
    if rc is None:
        print(f"== {part.name}: ran past --part-timeout={timeout:.0f}s: killed", flush=True)
    found = parse_verdicts(output)
    why = f"no verdict line (exit status {rc})" if rc is not None else \
        f"no verdict line within {timeout:.0f}s"
    return [found.get(c) or Verdict(c, "FAIL", why)
            for c in part.checks]


def overall(verdicts: list[Verdict]) -> tuple[Verdict, int]:
    by = {s: [v.check for v in verdicts if v.status == s] for s in ("PASS", "FAIL", "SKIP")}
    skipped = f"skipped: {', '.join(by['SKIP'])}" if by["SKIP"] else ""
    if by["FAIL"]:
        return Verdict("gpu_checks", "FAIL", ", ".join(by["FAIL"])), 1
    if not by["PASS"]:
        return Verdict("gpu_checks", "SKIP", "nothing could run here; " + skipped), 2
    why = f"passed: {', '.join(by['PASS'])}" + (f"; {skipped}" if skipped else "")
    return Verdict("gpu_checks", "PASS", why), 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--only", default="", help="comma-separated parts to run")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out")
    ap.add_argument("--part-timeout", type=float, default=1800)
    args = ap.parse_args()
    parts = select(args.only, args.skip)
    why = device_skip(args.device)
    if why:
        print(f"gpu_checks: SKIP ({why}: nothing was checked)", flush=True)
        return 2
    verdicts: list[Verdict] = []
    for part in parts:
        verdicts += run_part(part, args.device, args.part_timeout)
    print("== summary", flush=True)
    for v in verdicts:
        v.show()
    final, code = overall(verdicts)
    final.show()
    return code


if __name__ == "__main__":
    sys.exit(main())
