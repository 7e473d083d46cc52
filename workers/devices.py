"""Which device a worker computes on (pure): its own GPU, never another worker's; and the
refusal of model workers that share one (NCCL would refuse their group)."""
from __future__ import annotations

from typing import Any, Sequence

from system.errors import ConfigError
from system.reshard.backend import RankDevice, sharing


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


def default_group_refusal(ranks: Sequence[RankDevice]) -> str | None:
    """Why the model workers' default group cannot form on these devices (None: it can). It
    needs NCCL on GPUs (FSDP2's all_gather and reduce_scatter, megatron's groups), NCCL refuses
    two ranks on one GPU, and gloo has neither collective for CUDA tensors: model workers
    that share a GPU are refused, in one line naming the keys."""
    shared = sharing(ranks)
    if not shared:
        return None
    return (f"{shared}: the model workers' training group needs NCCL, which refuses two ranks "
            "on one GPU (and gloo lacks FSDP2's all_gather/reduce_scatter on CUDA); give each "
            "model worker a GPU of its own: lower model.count or give more GPUs "
            "(scheduler.local.gpus or CUDA_VISIBLE_DEVICES); scheduler.local.share_gpus=true "
            "shares GPUs between model workers and generation servers only")


def check_own_devices(store: Any, rank: int, world: int, device: str) -> None:
    """Before NCCL forms the model workers' default group (collective): each rank publishes
    its GPU's physical identity (:func:`~system.reshard.backend.device_identity`) in the
    group's store and reads every other's; ranks that share a GPU are refused
    (:func:`default_group_refusal`) instead of failing inside NCCL ("Duplicate GPU
    detected")."""
    store.set(f"rlsys/device/{rank}", device)
    ranks = [RankDevice(f"model-{r}", store.get(f"rlsys/device/{r}").decode())
             for r in range(world)]
    why = default_group_refusal(ranks)
    if why is not None:
        # every rank has read every device before any refuses: rank 0 hosts the store, and
        # a rank still reading when it exits would fail on the lost store, not with this line
        store.set(f"rlsys/device_read/{rank}", "1")
        store.wait([f"rlsys/device_read/{r}" for r in range(world)])
        raise ConfigError(why)
