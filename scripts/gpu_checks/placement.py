"""(e) GPU placement on this machine's real GPUs: what the local scheduler and the master's
weight-sync backend choice read from it (README "GPUs: placement").

- ``gpu_placement``:
  - ``scheduler.local.gpus=auto`` (:func:`scheduler.local.local_gpus`) lists the GPUs that
    ``nvidia-smi`` lists, as many as torch sees;
  - each GPU, seen from a fresh process through ``CUDA_VISIBLE_DEVICES=<index>`` (with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, as the scheduler sets it) and through
    ``CUDA_VISIBLE_DEVICES=<its UUID>``, has as ``cuda:0`` the identity
    (:func:`system.reshard.backend.device_identity`) that ``nvidia-smi`` prints for that index,
    and no two GPUs have one identity;
  - a model worker and a generation server planned over that list (sharing when there is one GPU,
    as ``scheduler.local.share_gpus=true``) get the backend the master would pick: NCCL on two
    GPUs, gloo with its one line on one.

SKIP: no CUDA, or no ``nvidia-smi``. CUDA only (its CPU counterparts are the planner's and the
backend choice's unit tests).

    python3 -m scripts.gpu_checks.placement
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Mapping, Sequence

from scripts.gpu_checks.common import ROOT, Verdict, device_skip, exit_code, out

CHECKS = ("gpu_placement",)
IDENTITY = "from system.reshard.backend import device_identity; print(device_identity('cuda:0'))"


def smi_uuids() -> list[tuple[str, str]] | None:
    """(index, UUID) of every GPU ``nvidia-smi`` lists, or None without ``nvidia-smi``;
    RuntimeError naming what it said when it fails or prints something else."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    r = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"nvidia-smi exited {r.returncode}: {r.stderr.strip()[:200]}")
    rows = [[x.strip() for x in line.split(",")] for line in r.stdout.splitlines()
            if line.strip()]
    if any(len(row) != 2 or not row[0].isdigit() for row in rows):
        raise RuntimeError(f"nvidia-smi printed rows other than index, uuid: {r.stdout[:200]!r}")
    return [(i, u) for i, u in rows]


def _python(code: str, env: Mapping[str, str]) -> str:
    """The last line a fresh interpreter running ``code`` prints, or ``error: <its last
    line>``."""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(env),
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or not r.stdout.strip():
        return f"error: {(r.stderr.strip().splitlines() or ['exit ' + str(r.returncode)])[-1]}"
    return r.stdout.strip().splitlines()[-1]


def torch_count_unrestricted() -> str:
    """How many GPUs a fresh process's torch counts with ``CUDA_VISIBLE_DEVICES`` unset (as
    ``nvidia-smi``, which ignores it, lists them)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return _python("import torch; print(torch.cuda.device_count())", env)


def identity_seen(visible: str) -> str:
    """``cuda:0``'s identity in a fresh process that sees ``CUDA_VISIBLE_DEVICES=visible``."""
    return _python(IDENTITY, dict(os.environ, CUDA_VISIBLE_DEVICES=visible,
                                  CUDA_DEVICE_ORDER="PCI_BUS_ID"))


def judge(smi: Sequence[tuple[str, str]], auto: Sequence[str], torch_count: str,
          seen: Mapping[tuple[str, str], str], backend: str, expected: str) -> list[str]:
    """What is wrong (empty: nothing): ``smi`` (index, UUID) rows, ``auto`` what
    ``scheduler.local.gpus=auto`` gave, ``torch_count`` what a process's torch counted with
    ``CUDA_VISIBLE_DEVICES`` unset, ``seen`` (index, by "index" or "uuid") -> identity,
    ``backend`` what the master picked for a model worker and a generation server planned over
    the GPUs, ``expected`` what it should be."""
    bad = []
    if tuple(auto) != tuple(i for i, _ in smi):
        bad.append(f"scheduler.local.gpus=auto gave {list(auto)}, nvidia-smi lists "
                   f"{[i for i, _ in smi]}")
    if torch_count != str(len(smi)):
        bad.append(f"torch sees {torch_count} GPUs, nvidia-smi lists {len(smi)}")
    for index, uuid in smi:
        for how in ("index", "uuid"):
            got = seen.get((index, how))
            if got != uuid:
                bad.append(f"GPU {index} seen by {how}: identity {got!r}, nvidia-smi {uuid!r}")
    if len({u for _, u in smi}) != len(smi):
        bad.append("two GPUs have one identity")
    if backend != expected:
        bad.append(f"model and generation on the planned GPUs: {backend}, expected {expected}")
    return bad


def run() -> list[Verdict]:
    why = device_skip("cuda")
    if why:
        return [Verdict("gpu_placement", "SKIP", why)]
    try:
        smi = smi_uuids()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return [Verdict("gpu_placement", "FAIL", str(e).splitlines()[0])]
    if not smi:
        return [Verdict("gpu_placement", "SKIP", "nvidia-smi is not installed or lists no GPU")]
    from scheduler.gpu_plan import GpuDemand, plan_gpus
    from scheduler.local import local_gpus
    from system.reshard.backend import RankDevice, choose_backend

    environ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    auto = local_gpus("auto", environ).ids
    out("nvidia_smi", "; ".join(f"{i} {u}" for i, u in smi))
    out("local_gpus_auto", ",".join(auto))
    seen = {}
    for index, uuid in smi:
        for how, visible in (("index", index), ("uuid", uuid)):
            seen[(index, how)] = identity_seen(visible)
            out(f"identity_gpu{index}_by_{how}", seen[(index, how)])
    share = len(smi) < 2
    plan = plan_gpus([i for i, _ in smi], [
        GpuDemand("model", 1, 1, "model.count", exclusive=True),
        GpuDemand("generation", 1, 1, "generation.count x rl.vllm.tensor_parallel_size")],
        share=share)
    out("plan", f"{dict(plan)} (share_gpus={str(share).lower()})")
    ident = dict(smi)
    choice = choose_backend([RankDevice("model-0", ident[plan["model/0"][0]]),
                             RankDevice("generation-0 tp0", ident[plan["generation/0"][0]])])
    out("backend", choice.line("weight sync with generation server 0"))
    counted = torch_count_unrestricted()
    out("torch_gpus_without_cuda_visible_devices", counted)
    bad = judge(smi, auto, counted, seen, choice.backend,
                "gloo" if share else "nccl")
    return [Verdict("gpu_placement", "FAIL" if bad else "PASS", "; ".join(bad))]


def main() -> int:
    return exit_code([v.show() for v in run()])


if __name__ == "__main__":
    sys.exit(main())
