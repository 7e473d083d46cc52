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
from system.reshard.megatron import check_megatron, megatron_local_params
from system.reshard.params import (Box, DstParam, ModelShape, ParamSpec, hf_local_params,
                                   qwen2_specs, train_local_params, train_shard_boxes,
                                   vllm_local_params)
from system.reshard.plan import ReshardPlan, plan_reshard

if TYPE_CHECKING:  # torch is imported by the ranks that run an executor
    import torch

    from system.reshard.executor import ReshardExecutor

MODES = ("fast", "load_weights")
SRC_BACKENDS = ("fsdp", "megatron")
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
    """gloo or nccl (the master picks it per group from its ranks' physical devices:
    :func:`~system.reshard.backend.choose_backend`)."""
    mode: str
    """fast (each generation rank receives its own shards, vLLM's fused names, in place) or
    load_weights (full Hugging Face tensors, handed to vLLM's loader)."""
    bucket_bytes: int
    timeout: float
    """Seconds a group waits for its members."""
    src_backend: str = "fsdp"
    """What the training ranks hold: fsdp (HF-named tensor-parallel shards of their stage; with
    ``src.fsdp`` each rank's FSDP2 dim-0 chunk of them) or megatron (megatron-core GPTModel tensors, local spec: see :mod:`system.reshard.megatron`;
    ranks ordered tp fastest, then dp, then pp, as megatron-core orders them)."""
    vocab_divisible_by: int = 128
    """megatron only: its make_vocab_size_divisible_by (the vocabulary is padded to a multiple
    of this times tp)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"weight-sync mode {self.mode!r} is not one of {list(MODES)}")
        if self.dtype not in ITEMSIZE:
            raise ConfigError(f"weight-sync dtype {self.dtype!r} is not one of {list(ITEMSIZE)}")
        if self.backend not in ("gloo", "nccl"):
            raise ConfigError(f"weight-sync backend {self.backend!r} is not gloo or nccl")
        if self.bucket_bytes < 1 or self.timeout <= 0:
            raise ConfigError("weight-sync bucket_bytes must be >= 1 and timeout > 0")
        if self.src_backend not in SRC_BACKENDS:
            raise ConfigError(f"weight-sync src_backend {self.src_backend!r} is not one of "
                              f"{list(SRC_BACKENDS)}")
        if self.vocab_divisible_by < 1:
            raise ConfigError(f"weight-sync vocab_divisible_by {self.vocab_divisible_by} must "
                              "be >= 1")
        if self.src_backend == "megatron":
            if self.src.fsdp:
                raise ConfigError(f"weight-sync src {self.src}: fsdp=1 (FSDP2 dim-0 chunks) is "
                                  "for the fsdp src_backend; megatron ranks hold whole tensors")
            check_megatron(self.shape, self.src.tp, self.src.pp)

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
        src_params = None
        if self.src_backend == "megatron":
            src_params = [self.src_params(r) for r in range(self.src.world_size)]
        return plan_reshard(self.src, dst, self.specs(), self.shape.num_layers,
                            itemsize=ITEMSIZE[self.dtype], bucket_bytes=self.bucket_bytes,
                            direct_bytes=direct_bytes, fused=self.fused, src_params=src_params)

    def gen_rank(self, replica: int, tp_rank: int) -> int:
        return self.src.world_size + self.dst.rank(replica, tp_rank)

    def src_boxes(self, rank: int) -> dict[str, Box]:
        """The box of every full parameter training ``rank`` holds (fsdp sources: HF-named
        shards; a megatron rank's tensors are described by :meth:`src_params`)."""
        if self.src_backend != "fsdp":
            raise ConfigError(f"src_boxes is for fsdp sources; a {self.src_backend} rank's "
                              "tensors are given by src_params")
        return train_shard_boxes(self.specs(), self.src, rank, self.shape.num_layers)

    def src_params(self, rank: int) -> list[DstParam]:
        """Training ``rank``'s local tensors (the names and shapes it passes to its executor),
        with the boxes of HF parameters each holds."""
        if self.src_backend == "megatron":
            c = self.src.coord(rank)
            return megatron_local_params(self.shape, self.src.tp, c.tp, self.src.pp, c.pp,
                                         self.vocab_divisible_by)
        return train_local_params(self.specs(), self.src, rank, self.shape.num_layers)

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
                "timeout": self.timeout, "src_backend": self.src_backend,
                "vocab_divisible_by": self.vocab_divisible_by}

    @staticmethod
    def from_wire(d: dict[str, Any]) -> "WeightSyncSpec":
        return WeightSyncSpec(src=TrainLayout(**d["src"]), dst=GenLayout(**d["dst"]),
                              shape=ModelShape(**d["shape"]), dtype=str(d["dtype"]),
                              backend=str(d["backend"]), mode=str(d["mode"]),
                              bucket_bytes=int(d["bucket_bytes"]), timeout=float(d["timeout"]),
                              src_backend=str(d["src_backend"]),
                              vocab_divisible_by=int(d["vocab_divisible_by"]))
