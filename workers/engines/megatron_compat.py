"""The one place that knows megatron-core's version and its CUDA-only call sites.

megatron-core has no CPU mode: it allocates buffers with ``device="cuda"`` or
``torch.cuda.current_device()``, moves tensors with ``.cuda()``, asserts
``param.type() == 'torch.cuda.FloatTensor'`` in its optimizers, and calls
``torch.cuda.synchronize()``. On CPU (tests, CI, this project's CPU machines) :func:`cpu_shim`
makes those call sites work while megatron's code runs: a ``TorchFunctionMode`` maps CUDA device
arguments to the CPU and reports CPU tensor types under their CUDA names, and
``torch.cuda.current_device``/``synchronize`` answer as a one-device host would. Outside the shim
nothing is changed; on a GPU the shim is a no-op (NCCL, bf16, Transformer Engine where it is
installed).

Only :data:`SUPPORTED` is accepted: the call sites above (and the private optimizer helpers
used for checkpoints) are those of that release.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from system.errors import ConfigError

SUPPORTED = "0.16.1"


def check_version() -> str:
    """megatron-core's version, or ``ConfigError`` in one line when it is missing or another."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"rl.actor.backend=megatron needs megatron-core=={SUPPORTED} "
                          "(pip install -e '.[cpu]')") from None
    if version != SUPPORTED:
        raise ConfigError(f"megatron-core {version} is installed; this engine supports exactly "
                          f"{SUPPORTED} (its CUDA-only call sites and optimizer internals)")
    return version


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
               "torch.HalfTensor": "torch.cuda.HalfTensor"}


class _CudaToCpu(TorchFunctionMode):
    """CUDA device arguments become the CPU; ``Tensor.cuda()`` stays put; ``Tensor.type()``
    names CPU float tensors as megatron's optimizers expect."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPES.get(name, name)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}


@contextlib.contextmanager
def _patched_cuda_module() -> Iterator[None]:
    """``torch.cuda.current_device()`` -> 0 (which the mode maps to the CPU) and
    ``torch.cuda.synchronize()`` -> nothing, re-entrantly."""
    global _depth
    with _lock:
        if _depth == 0:
            _saved.update(current_device=torch.cuda.current_device,
                          synchronize=torch.cuda.synchronize)
            torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
            torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.cuda.current_device = _saved["current_device"]  # type: ignore[assignment]
                torch.cuda.synchronize = _saved["synchronize"]  # type: ignore[assignment]


@contextlib.contextmanager
def cpu_shim(device: torch.device) -> Iterator[None]:
    """Run megatron-core code on ``device``: on the CPU with its CUDA call sites redirected,
    on a GPU untouched."""
    if device.type == "cuda":
        yield
        return
    with _patched_cuda_module(), _CudaToCpu():
        yield


TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
"""Where Transformer Engine's spec keeps the local spec's layer norms (fused into the next
linear); every other parameter name is the same."""


def layer_spec(device: torch.device, qk_norm: bool = False) -> tuple[Any, bool]:
    """``(spec, uses_te)``: Transformer Engine's layer spec on a GPU where it is importable,
    the local (plain torch) spec otherwise (always on the CPU). ``qk_norm``: per-head RMSNorm of
    queries and keys (Qwen3)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if device.type == "cuda":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            pass
        else:
            return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm), True
    return specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm), False
