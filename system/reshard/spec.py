"""The weight-sync spec: one typed description of a trainer -> generation weight update.

The master builds it once; model workers, generation servers (and the vLLM extension inside
them) and the check command receive the same spec and derive everything from it: the plan
(:meth:`WeightSyncSpec.plan`, pure and identical on every rank), each rank's executor, and the
shards each side holds. On the wire it travels as :meth:`to_wire` (plain values).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from system.errors import ConfigError
from system.reshard.layout import GenLayout, TrainLayout
from system.reshard.params import (Box, DstParam, ModelShape, ParamSpec, hf_local_params,
                                   qwen2_specs, train_shard_boxes, vllm_local_params)
from system.reshard.plan import ReshardPlan, plan_reshard

if TYPE_CHECKING:  # torch is imported by the ranks that run an executor
    import torch

    from system.reshard.executor import ReshardExecutor

MODES = ("fast", "load_weights")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class WeightSyncSpec:
    """Training ranks ``0 .. src.world_size - 1`` send; generation rank ``(replica, tp)`` is
    global rank ``src.world_size + dst.rank(replica, tp)``."""

    src: TrainLayout
    dst: GenLayout
    shape: ModelShape
    dtype: str
    """Parameter dtype on both sides: float32, bfloat16 or float16."""
    backend: str
    """gloo or nccl."""
    mode: str
    """fast (each generation rank receives its own shards, vLLM's fused names, in place) or
    load_weights (full Hugging Face tensors, handed to vLLM's loader)."""
    bucket_bytes: int
    timeout: float
    """Seconds a group waits for its members."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"weight-sync mode {self.mode!r} is not one of {list(MODES)}")
        if self.dtype not in ITEMSIZE:
            raise ConfigError(f"weight-sync dtype {self.dtype!r} is not one of {list(ITEMSIZE)}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"weight-sync backend {self.backend!r} is not gloo or nccl")
        if self.bucket_bytes < 1 or self.timeout <= 0:
            raise ConfigError("weight-sync bucket_bytes must be >= 1 and timeout > 0")

    @property
    def world_size(self) -> int:
        return self.src.world_size + self.dst.world_size

    @property
    def fused(self) -> bool:
        return self.mode == "fast"

    def specs(self) -> list[ParamSpec]:
        return qwen2_specs(self.shape)

    def plan(self, direct_bytes: int = 1 << 20) -> ReshardPlan:
        """The plan every rank derives (pure; the same on every rank). ``load_weights`` plans
        for unfused full tensors on every generation rank."""
        dst = self.dst if self.fused else GenLayout(tp=1, replicas=self.dst.world_size)
        return plan_reshard(self.src, dst, self.specs(), self.shape.num_layers,
                            itemsize=ITEMSIZE[self.dtype], bucket_bytes=self.bucket_bytes,
                            direct_bytes=direct_bytes, fused=self.fused)

    def gen_rank(self, replica: int, tp_rank: int) -> int:
        return self.src.world_size + self.dst.rank(replica, tp_rank)

    def src_boxes(self, rank: int) -> dict[str, Box]:
        """The box of every full parameter training ``rank`` holds."""
        return train_shard_boxes(self.specs(), self.src, rank, self.shape.num_layers)

    def dst_params(self, tp_rank: int) -> list[DstParam]:
        """What generation tp rank ``tp_rank`` receives (fused shards, or full HF tensors)."""
        if self.fused:
            return vllm_local_params(self.specs(), self.dst.tp, tp_rank)
        return hf_local_params(self.specs(), 1, 0)

    def executor(self, rank: int, store: Any, device: "torch.device | str" = "cpu",
                 plan: ReshardPlan | None = None, lanes: int | None = None
                 ) -> "ReshardExecutor":
        """Rank ``rank``'s executor over groups formed from ``store`` (collective: every rank
        of the spec constructs its own)."""
        import torch

        from system.reshard.executor import GroupFactory, ReshardExecutor

        groups = GroupFactory(store, rank, self.backend, self.timeout)
        return ReshardExecutor(plan or self.plan(), rank, groups, device=device,
                               dtype=getattr(torch, self.dtype), lanes=lanes)

    def to_wire(self) -> dict[str, Any]:
        return {"src": dataclasses.asdict(self.src), "dst": dataclasses.asdict(self.dst),
                "shape": dataclasses.asdict(self.shape), "dtype": self.dtype,
                "backend": self.backend, "mode": self.mode, "bucket_bytes": self.bucket_bytes,
                "timeout": self.timeout}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> "WeightSyncSpec":
        return WeightSyncSpec(src=TrainLayout(**d["src"]), dst=GenLayout(**d["dst"]),
                              shape=ModelShape(**d["shape"]), dtype=str(d["dtype"]),
                              backend=str(d["backend"]), mode=str(d["mode"]),
                              bucket_bytes=int(d["bucket_bytes"]), timeout=float(d["timeout"]))
