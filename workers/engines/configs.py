"""Configs of the training engines, importable without torch (the launcher reads them)."""
from __future__ import annotations

import dataclasses

from system.errors import ConfigError


BACKENDS = ("fsdp", "megatron")


@dataclasses.dataclass
class MegatronConfig:
    """The megatron-core engine's model parallelism (data parallel: the rest of the workers)."""

    tp: int = 1
    """Tensor-parallel ranks (must divide the attention heads; kv heads are replicated when
    fewer than tp)."""
    pp: int = 1
    """Pipeline stages (must divide the layers)."""

    def __post_init__(self) -> None:
        for key in ("tp", "pp"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be an int >= 1, got {getattr(self, key)!r}")


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
    backend: str = "fsdp"
    """fsdp (transformers model + FSDP2, data parallel over the model workers) or megatron
    (megatron-core GPTModel, tp x pp x dp)."""
    megatron: MegatronConfig = dataclasses.field(default_factory=MegatronConfig)
    """backend=megatron: tp and pp (dp = model workers / (tp x pp))."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):  # (AdamW raises on others, in every model worker)
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{key} must be in [0, 1), got {getattr(self, key)}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (0: no clipping), got {self.grad_clip}")
        if self.max_tokens_per_microbatch < 1:
            raise ConfigError("max_tokens_per_microbatch must be >= 1")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype={self.dtype!r} is not one of auto, float32, bfloat16")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.backend != "megatron" and (self.megatron.tp, self.megatron.pp) != (1, 1):
            raise ConfigError(f"megatron.tp/pp are set but backend={self.backend!r} "
                              "(use backend=megatron)")

    def check_layout(self, workers: int, model_config: dict | None = None,
                     key: str = "megatron") -> None:
        """Refuse, naming the key (``key``: where the megatron section is mounted), a megatron
        split that ``workers`` model workers (and the model's ``config.json`` values, when
        given) cannot make."""
        if self.backend != "megatron":
            return
        tp, pp = self.megatron.tp, self.megatron.pp
        if workers % (tp * pp):
            raise ConfigError(f"{key}.tp x {key}.pp = {tp} x {pp} does not divide "
                              f"model.count={workers}")
        if model_config is None:
            return
        heads = int(model_config["num_attention_heads"])
        kv = int(model_config.get("num_key_value_heads") or heads)
        layers = int(model_config["num_hidden_layers"])
        if heads % tp:
            raise ConfigError(f"{key}.tp={tp} does not divide the model's {heads} "
                              "attention heads")
        if kv % tp and tp % kv:
            raise ConfigError(f"{key}.tp={tp} and the model's {kv} kv heads do not divide "
                              "each other")
        if layers % pp:
            raise ConfigError(f"{key}.pp={pp} does not divide the model's {layers} layers")
        inter = int(model_config.get("intermediate_size") or 0)
        if inter % tp:
            raise ConfigError(f"{key}.tp={tp} does not divide the model's intermediate_size "
                              f"{inter}")
