"""Layouts of training and generation ranks, validated at construction.

Training ranks are ordered as in Megatron (tensor-parallel fastest, then data-parallel, then
pipeline): ``rank = (pp * dp_size + dp) * tp_size + tp``. Generation ranks are
``rank = replica * tp_size + tp``.

With ``fsdp`` the data-parallel ranks are not copies: as in FSDP2's ``fully_shard``, each holds
one dim-0 chunk of its (tensor-parallel) shard of every parameter (:func:`fsdp_rows`), so a
publish sends each rank's own chunk and nobody gathers the full model.
"""
from __future__ import annotations

import dataclasses
import re

from system.errors import ConfigError


class LayoutError(ConfigError):
    """A layout does not fit its world size or cannot be resharded to another."""


@dataclasses.dataclass(frozen=True)
class TrainCoord:
    dp: int
    tp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """dp x tp x pp training ranks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    """Data-parallel ranks hold dim-0 chunks (FSDP2), not copies, of their shards."""

    def __post_init__(self) -> None:
        for k in ("dp", "tp", "pp"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise LayoutError(f"training layout {k}={getattr(self, k)!r} must be an int >= 1")
        if not isinstance(self.fsdp, bool):
            raise LayoutError(f"training layout fsdp={self.fsdp!r} must be a bool")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coord(self, rank: int) -> TrainCoord:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside {self}")
        return TrainCoord(dp=(rank // self.tp) % self.dp, tp=rank % self.tp,
                          pp=rank // (self.tp * self.dp))

    def rank(self, dp: int, tp: int, pp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp}" + (",fsdp=1" if self.fsdp else "")


@dataclasses.dataclass(frozen=True)
class GenLayout:
    """tp x replicas generation ranks (one vLLM engine per replica, tp inside it)."""

    tp: int = 1
    replicas: int = 1

    def __post_init__(self) -> None:
        for k in ("tp", "replicas"):
            if not isinstance(getattr(self, k), int) or getattr(self, k) < 1:
                raise LayoutError(f"generation layout {k}={getattr(self, k)!r} must be an int >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.replicas

    def coord(self, rank: int) -> tuple[int, int]:
        """``(replica, tp)``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside {self}")
        return rank // self.tp, rank % self.tp

    def rank(self, replica: int, tp: int) -> int:
        return replica * self.tp + tp

    def __str__(self) -> str:
        return f"tp={self.tp},replicas={self.replicas}"


def fsdp_rows(lo: int, hi: int, dp: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` as FSDP2 shards them over ``dp`` ranks: ``torch.chunk`` (chunks of
    ``ceil(n / dp)`` rows, the last ones shorter or empty), the part of ``rank``."""
    n = hi - lo
    size = -(-n // dp)
    return lo + min(rank * size, n), lo + min((rank + 1) * size, n)


def _parse(text: str, allowed: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        m = re.fullmatch(r"(\w+)=(\d+)", part)
        if not m or m.group(1) not in allowed:
            raise LayoutError(f"{part!r} in {text!r}: expected k=N with k in {list(allowed)}")
        out[m.group(1)] = int(m.group(2))
    return out


def parse_train_layout(text: str) -> TrainLayout:
    """``"dp=2,tp=2,pp=1"`` (missing factors are 1); ``fsdp=1``: FSDP2 dim-0 shards over dp."""
    d = _parse(text, ("dp", "tp", "pp", "fsdp"))
    if d.get("fsdp", 0) not in (0, 1):
        raise LayoutError(f"fsdp={d['fsdp']} in {text!r}: expected fsdp=0 or fsdp=1")
    return TrainLayout(**{k: v for k, v in d.items() if k != "fsdp"}, fsdp=bool(d.get("fsdp")))


def parse_gen_layout(text: str) -> GenLayout:
    """``"tp=2,replicas=2"``."""
    return GenLayout(**_parse(text, ("tp", "replicas")))
