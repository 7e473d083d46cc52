"""Configs of the training engines, importable without torch (the launcher reads them)."""
from __future__ import annotations

import dataclasses

from system.errors import ConfigError


@dataclasses.dataclass
class TorchEngineConfig:
    """The torch training engine of one model role (actor, reference, critic)."""

    model_path: str = ""
    """Local directory of a Hugging Face checkpoint (nothing is downloaded)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward/backward (padded length x sequences)."""
    dtype: str = "auto"
    """Weight dtype: auto (float32 on CPU, bfloat16 on GPU), float32 or bfloat16. On GPU,
    bfloat16 (and auto) is mixed precision: float32 master weights and AdamW state, bfloat16
    compute, weights published (weight sync, ``save_weights``) in bfloat16. On CPU the
    parameters are this dtype."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        if self.max_tokens_per_microbatch < 1:
            raise ConfigError("max_tokens_per_microbatch must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of auto, float32, bfloat16")
