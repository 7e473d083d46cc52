"""Which device a worker computes on (pure): its own GPU, never another worker's."""
from __future__ import annotations

from system.errors import ConfigError


def select_device(local_rank: int, visible: int) -> str:
    """The device of a worker at ``local_rank`` on its node that sees ``visible`` CUDA devices:
    the CPU without any; ``cuda:0`` when it sees one (placement gave it its own: a local
    worker's ``CUDA_VISIBLE_DEVICES``, a Slurm task's narrowed slice); otherwise its
    ``local_rank``-th (a task that sees its whole node's GPUs, one per task). A local rank past
    the visible devices is refused rather than wrapped onto a GPU another worker uses (NCCL
    refuses two ranks on one device)."""
    if visible <= 0:
        return "cpu"
    if visible == 1:
        return "cuda:0"
    if local_rank >= visible:
        raise ConfigError(f"the worker at local rank {local_rank} sees {visible} GPUs, none of "
                          "them its own; give each model worker one GPU (scheduler.local.gpus, "
                          "or scheduler.slurm.gpus=true / scheduler.slurm.model.gpus_per_node)")
    return f"cuda:{local_rank}"
