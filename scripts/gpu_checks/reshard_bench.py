"""(a) The reshard benchmark over NCCL: how close a weight update comes to the measured link.

Runs ``tests/benchmarks/reshard.py`` (its transfer part only: no megatron or FSDP memory part)
with the largest layout the visible GPUs hold with one rank per GPU (NCCL refuses two ranks of
one group on one GPU: "Duplicate GPU detected"), and reads ``fraction_of_link`` (bytes per
generation rank per second of ours / of one flat broadcast of the same size on the same ranks)
and ``speedup_vs_naive``. PASS when the benchmark completes and ``fraction_of_link`` >=
``--min-fraction`` (0.5 on CUDA). The CPU twin (``--device cpu``) is the same benchmark over
gloo on a tiny model with two processes; it checks the plumbing, not the speed (a tiny model's
transfer is latency-bound: 0.18-0.26 of the link here), so its default threshold is 0.

    python3 -m scripts.gpu_checks.reshard_bench [--device cuda|cpu] [--min-fraction 0.5]
"""
from __future__ import annotations

import os
import sys

from scripts.gpu_checks.common import (ROOT, Verdict, base_parser, cuda_devices, device_skip,
                                       exit_code, need, out, run_group)

CHECK = "reshard_bench"
CHECKS = (CHECK,)
BENCH = os.path.join(ROOT, "tests", "benchmarks", "reshard.py")
# (processes, source layout, destination layout), the largest first
LAYOUTS = ((8, "dp=2,tp=2,pp=1", "tp=2,replicas=2"), (4, "dp=1,tp=2,pp=1", "tp=2,replicas=1"),
           (2, "dp=1,tp=1,pp=1", "tp=1,replicas=1"))


def pick_layout(ranks: int) -> tuple[str, str] | None:
    """The largest benchmark layout with at most ``ranks`` processes."""
    for n, src, dst in LAYOUTS:
        if n <= ranks:
            return src, dst
    return None


def layout_or_skip(ranks: int) -> tuple[str, str] | str:
    """The layout for ``ranks`` processes (one per GPU), or why the benchmark cannot run."""
    layout = pick_layout(ranks)
    if layout is None:
        return (f"{ranks} GPU: the NCCL benchmark needs 2 ranks on 2 GPUs (NCCL refuses two "
                "ranks on one GPU: Duplicate GPU detected)")
    return layout


def bench_args(backend: str, src: str, dst: str, model: str, repeat: int) -> list[str]:
    return [BENCH, "--backend", backend, "--src", src, "--dst", dst, "--model", model,
            "--repeat", str(repeat), "--megatron", "", "--fsdp-dp", "0"]


def figures(text: str) -> dict[str, float]:
    """The benchmark's numeric ``name: value`` lines."""
    res: dict[str, float] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        try:
            res[name.strip()] = float(value) if sep else float("nan")
        except ValueError:
            continue
    return res


def judge(res: dict[str, float], min_fraction: float) -> Verdict:
    frac = res.get("fraction_of_link")
    if frac is None or frac != frac:
        return Verdict(CHECK, "FAIL", "the benchmark printed no fraction_of_link")
    if frac < min_fraction:
        return Verdict(CHECK, "FAIL", f"fraction_of_link {frac:.2f} < {min_fraction}")
    return Verdict(CHECK, "PASS")


def run(device: str, model: str, repeat: int, min_fraction: float, timeout: float) -> Verdict:
    why = device_skip(device) or need("system.reshard.check", "system.reshard.executor")
    if why:
        return Verdict(CHECK, "SKIP", why)
    backend = "nccl" if device == "cuda" else "gloo"
    ranks = cuda_devices() if device == "cuda" else 2
    layout = layout_or_skip(ranks)
    if isinstance(layout, str):
        return Verdict(CHECK, "SKIP", layout)
    src, dst = layout
    out("reshard_layout", f"{src} -> {dst}, {backend}, model {model}")
    rc, output = run_group([sys.executable, *bench_args(backend, src, dst, model, repeat)],
                           timeout)  # (its ranks die with it: a hung one keeps no GPU)
    if rc is None:
        return Verdict(CHECK, "FAIL", f"the benchmark ran past {timeout:.0f}s")
    if rc != 0:
        tail = (output.strip().splitlines() or ["no output"])[-1]
        return Verdict(CHECK, "FAIL", f"the benchmark exited {rc}: {tail}")
    res = figures(output)
    for name in ("speedup_vs_naive", "ours_GBps_per_generation_rank",
                 "link_GBps_per_generation_rank", "fraction_of_link"):
        if name in res:
            out(f"reshard_{name}", res[name])
    out("reshard_min_fraction_of_link", min_fraction)
    return judge(res, min_fraction)


def main() -> int:
    ap = base_parser(__doc__)
    ap.add_argument("--bench-model", default=None,
                    help="the benchmark's model shapes (default: medium on cuda, tiny on cpu)")
    ap.add_argument("--repeat", type=int, default=None, help="timed rounds (default 11; cpu 3)")
    ap.add_argument("--min-fraction", type=float, default=None,
                    help="fraction_of_link needed to pass (default 0.5 on cuda, 0 on cpu)")
    ap.add_argument("--timeout", type=float, default=480)
    args = ap.parse_args()
    cpu = args.device == "cpu"
    v = run(args.device, args.bench_model or ("tiny" if cpu else "medium"),
            args.repeat or (3 if cpu else 11),
            args.min_fraction if args.min_fraction is not None else (0.0 if cpu else 0.5),
            args.timeout).show()
    return exit_code([v])


if __name__ == "__main__":
    sys.exit(main())
