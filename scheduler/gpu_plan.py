"""GPU placement (pure): which devices each worker sees.

Locally, :func:`plan_gpus` hands each worker its own GPUs out of the launcher's visible ones
(``CUDA_VISIBLE_DEVICES`` or ``scheduler.local.gpus``; ids are kept as given, so a
non-contiguous ``2,5,7`` maps worker by worker onto those physical ids), in the order of the
demands (model workers first), and refuses in one line, naming the keys, when there are too few.
Under Slurm the job holds every GPU of its tasks on a node and :func:`task_env` narrows, per
task, ``CUDA_VISIBLE_DEVICES`` to the task's own slice (its local rank's ``gpus_per_task``
devices) and sets the ranks torch.distributed and megatron read (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from system.errors import ConfigError

GPUS_PER_TASK_ENV = "RLSYS_GPUS_PER_TASK"
"""Set by a Slurm job script that requests GPUs: the devices each of its tasks takes."""


class GpuPlanError(ConfigError):
    """Not enough GPUs for the trial, or a task whose slice of the node's GPUs is not there."""


@dataclasses.dataclass(frozen=True)
class GpuDemand:
    """``count`` workers of ``kind``, each needing ``per_worker`` GPUs; ``keys`` names the
    config keys that set them (for the refusal), e.g. ``generation.count x
    rl.vllm.tensor_parallel_size``."""

    kind: str
    count: int
    per_worker: int
    keys: str
    exclusive: bool = False
    """Its workers form one NCCL group among themselves (model workers: FSDP2, megatron), and
    NCCL refuses two ranks on one GPU: even when workers share GPUs, none of these may share
    one with another of its kind (it may with other kinds)."""

    def __post_init__(self) -> None:
        if self.count < 0 or self.per_worker < 0:
            raise ValueError(f"GpuDemand {self.kind}: count={self.count}, "
                             f"per_worker={self.per_worker} must be >= 0")

    @property
    def total(self) -> int:
        return self.count * self.per_worker


def parse_visible(text: str) -> tuple[str, ...]:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: comma-separated ids (indices, ``GPU-<uuid>``
    or ``MIG-<uuid>``), spaces ignored, ending at the first invalid (negative) index, as CUDA
    ignores every device after one. Empty: none."""
    out: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if re.fullmatch(r"-\d+", item):
            break
        if not re.fullmatch(r"[A-Za-z0-9_-]+", item):
            raise ConfigError(f"GPU id {item!r} in {text!r} is not valid; valid: indices such "
                              "as 0,2,5 or GPU-/MIG- UUIDs, comma-separated")
        out.append(item)
    if len(set(out)) != len(out):
        raise ConfigError(f"GPU ids {text!r} name a device twice")
    return tuple(out)


def plan_gpus(visible: Sequence[str], demands: Sequence[GpuDemand],
              share: bool = False) -> dict[str, tuple[str, ...]]:
    """Worker name (``kind/index``) -> the GPU ids it sees, for every worker of ``demands``:
    consecutive slices of ``visible`` in demand order; a worker that needs none sees none
    (``()``). GpuPlanError naming the keys when ``visible`` is too short, unless ``share``:
    then the slices wrap around (workers share devices; one worker's own are still distinct)."""
    need = sum(d.total for d in demands)
    widest = max((d.per_worker for d in demands if d.count), default=0)
    if need > len(visible) and (not share or widest > len(visible)):
        parts = " + ".join(f"{d.count} x {d.per_worker} ({d.keys})"
                           for d in demands if d.total)
        shown = ",".join(visible) if visible else "none"
        what = f"{need} GPUs, one set per worker: {parts}" if not share else \
            f"{widest} GPUs for one worker ({parts})"
        raise GpuPlanError(
            f"the trial needs {what}; {len(visible)} visible ({shown}); lower those keys, give "
            "more GPUs (scheduler.local.gpus or CUDA_VISIBLE_DEVICES), let workers share them "
            "(scheduler.local.share_gpus=true), or run on the CPU (scheduler.local.gpus=none)")
    plan: dict[str, tuple[str, ...]] = {}
    at = 0
    for d in demands:
        for i in range(d.count):
            plan[f"{d.kind}/{i}"] = tuple(visible[(at + j) % len(visible)]
                                          for j in range(d.per_worker))
            at += d.per_worker
    if share:
        for d in demands:
            _check_exclusive(d, plan, len(visible))
    return plan


def _check_exclusive(d: GpuDemand, plan: dict[str, tuple[str, ...]], visible: int) -> None:
    """Refuse, in one line naming the keys, an exclusive kind whose workers were given a
    shared GPU (sharing wrapped around within the kind)."""
    if not d.exclusive:
        return
    seen: dict[str, str] = {}
    for i in range(d.count):
        for gpu in plan[f"{d.kind}/{i}"]:
            if gpu in seen:
                raise GpuPlanError(
                    f"{seen[gpu]} and {d.kind}/{i} would share GPU {gpu} "
                    f"(scheduler.local.share_gpus=true with {d.count} x {d.per_worker} "
                    f"({d.keys}) on {visible} visible): they form one NCCL group, and NCCL "
                    "refuses two ranks on one GPU (gloo lacks FSDP2's all_gather/reduce_scatter "
                    f"on CUDA); lower {d.keys} to at most {visible // max(1, d.per_worker)} or "
                    "give more GPUs (scheduler.local.gpus or CUDA_VISIBLE_DEVICES); share_gpus then "
                    "shares them with the other workers only")
            seen[gpu] = f"{d.kind}/{i}"


def task_devices(visible: Sequence[str], local_rank: int, per_task: int) -> tuple[str, ...]:
    """The devices of the task at ``local_rank`` among a node's ``visible`` ones: slice
    ``local_rank`` of ``per_task``; ``visible`` itself when it already is one task's set
    (Slurm bound the task, e.g. ``--gpu-bind``)."""
    if per_task < 1:
        raise ValueError(f"per_task={per_task} must be >= 1")
    if len(visible) == per_task:
        return tuple(visible)
    lo = local_rank * per_task
    if lo + per_task > len(visible):
        raise GpuPlanError(
            f"task at local rank {local_rank} needs GPUs {lo}..{lo + per_task - 1} of its node "
            f"but sees {len(visible)} ({','.join(visible) or 'none'}); the job must request "
            f"{per_task} GPU(s) per task on each node (scheduler.slurm.<group>.gpus_per_node)")
    return tuple(visible[lo:lo + per_task])


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list: ``a[1-3,5],b`` -> ``a1 a2 a3 a5 b`` (zero padding kept)."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?(?:,|$)", text):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            out.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                out.append(f"{prefix}{n:0{len(lo)}d}")
    return out


def task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What a Slurm task sets in its own environment before anything touches CUDA: the ranks
    (``RANK`` = worker index, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; for a job of a whole group
    also ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``: the first node of the job, a port
    from the job id, unless already set), and with ``RLSYS_GPUS_PER_TASK`` its own slice of ``CUDA_VISIBLE_DEVICES``.
    Empty outside Slurm."""
    if "SLURM_JOB_ID" not in environ:
        return {}
    base = int(environ.get("RLSYS_WORKER_BASE") or 0)
    rank = base + int(environ.get("SLURM_PROCID", 0))
    local = int(environ.get("SLURM_LOCALID", 0))
    nodes = expand_nodelist(environ.get("SLURM_JOB_NODELIST", "")) or ["127.0.0.1"]
    out = {"RANK": str(rank), "LOCAL_RANK": str(local),
           "LOCAL_WORLD_SIZE": _tasks_on_node(environ)}
    if not base:  # a job that restarts one worker alone is no torch.distributed job of its own
        out.update({"WORLD_SIZE": environ.get("SLURM_NTASKS", "1"),
                    "MASTER_ADDR": environ.get("MASTER_ADDR") or nodes[0],
                    "MASTER_PORT": environ.get("MASTER_PORT")
                    or str(20000 + int(environ["SLURM_JOB_ID"]) % 20000)})
    per_task = int(environ.get(GPUS_PER_TASK_ENV) or 0)
    if per_task:
        visible = parse_visible(environ.get("CUDA_VISIBLE_DEVICES", ""))
        out["CUDA_VISIBLE_DEVICES"] = ",".join(task_devices(visible, local, per_task))
    return out


def _tasks_on_node(environ: Mapping[str, str]) -> str:
    """``SLURM_TASKS_PER_NODE`` (``2(x3),1``) at this node's index, as a string."""
    counts: list[int] = []
    for part in environ.get("SLURM_TASKS_PER_NODE", "1").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(environ.get("SLURM_NODEID", 0))
    return str(counts[node] if node < len(counts) else 1)
