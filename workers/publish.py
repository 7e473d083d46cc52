"""A training engine's side of a weight publish: each rank sends its own shards as they live.

An FSDP2 rank holds a dim-0 chunk of every parameter (a DTensor's local tensor); the weight-sync
spec's training layout says so (``TrainLayout.fsdp``), so the planner has each region sent by
the rank whose chunk holds it, straight into vLLM's layout. Nothing gathers the model: a rank's
extra memory during a publish is the executor's in-flight buckets (and, where the master dtype
is not the publish dtype, the per-bucket cast copies).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol

from system.reshard.layout import LayoutError
from system.reshard.params import Box, box_shape, check_mapped
from system.reshard.spec import WeightSyncSpec

if TYPE_CHECKING:
    import torch

    from system.reshard.executor import ReshardExecutor


class ShardSource(Protocol):
    """What a publish needs of an engine (``TorchEngine``)."""

    def local_shards(self) -> "dict[str, torch.Tensor]": ...


def source_boxes(spec: WeightSyncSpec, rank: int, shards: "Mapping[str, torch.Tensor]",
                 who: str = "the actor") -> dict[str, Box]:
    """The box of every full parameter training ``rank`` sends, after checking that the
    engine's weights are exactly the specs' (one line naming a weight the specs do not map: it
    would stay stale in the generation servers) and that each shard it holds has the planned
    shape (an FSDP2 chunk on a sharded engine, the full tensor otherwise)."""
    check_mapped(spec.specs(), list(shards), who)
    boxes = spec.src_boxes(rank)
    for name, box in boxes.items():
        if tuple(shards[name].shape) != box_shape(box):
            raise LayoutError(f"{who} rank {rank} holds {name} as {tuple(shards[name].shape)}, "
                              f"the plan for {spec.src} expects {box_shape(box)}")
    return boxes


def send_shards(executor: "ReshardExecutor", engine: ShardSource,
                boxes: Mapping[str, Box]) -> int:
    """Send this rank's planned regions of the engine's current weights (collective with the
    plan's other ranks); returns the bytes sent. Shards in another dtype than the spec's are
    cast bucket by bucket as they are packed."""
    shards = engine.local_shards()
    return executor.run(src={n: shards[n] for n in boxes}, src_boxes=boxes).bytes_sent
