"""Building megatron-core's ``GPTModel`` for a Qwen2/Llama/Qwen3 Hugging Face config: the parallel
state, the transformer config, the model (wrapped in megatron's DDP) and its optimizer.

Every function here runs megatron code and must be called inside
:func:`workers.engines.megatron_compat.cpu_shim` (a no-op on a GPU).
"""
from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch
import torch.nn.functional as F

from system.errors import ConfigError
from system.reshard.megatron import check_megatron, padded_vocab
from system.reshard.params import ModelShape


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """tp x pp x dp megatron ranks over ``world`` model workers."""

    world: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"megatron tp={self.tp}, pp={self.pp} must be >= 1")
        if self.world % (self.tp * self.pp):
            raise ConfigError(f"model.count={self.world} is not a multiple of megatron "
                              f"tp x pp = {self.tp} x {self.pp}")

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)


def init_parallel(dims: ParallelDims, device: torch.device, seed: int,
                  timeout_s: float = 120.0) -> None:
    """megatron's process groups over the default group (a one-rank gloo group is made when
    there is none: megatron needs one even for a single worker). Called once per process; a
    second engine (reference, critic) must use the same dims."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        if dims.world != 1:
            raise RuntimeError("the default process group must exist for megatron at world > 1")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size())
        if have != (dims.tp, dims.pp):
            raise ConfigError(f"megatron engines of one worker need one layout: tp, pp = {have} "
                              f"already, {(dims.tp, dims.pp)} asked")
        return
    if dist.get_world_size() != dims.world:
        raise RuntimeError(f"default group has {dist.get_world_size()} ranks, "
                           f"megatron dims expect {dims.world}")
    ps.initialize_model_parallel(tensor_model_parallel_size=dims.tp,
                                 pipeline_model_parallel_size=dims.pp,
                                 distributed_timeout_minutes=max(1, int(timeout_s // 60)))
    # dropout is 0: the inference tracker avoids CUDA RNG state handling on the CPU
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def transformer_config(hf: Any, shape: ModelShape, dims: ParallelDims, mixed: bool,
                       params_dtype: torch.dtype) -> Any:
    """megatron's ``TransformerConfig`` for a Qwen2/Llama/Qwen3 config whose shape megatron builds
    is ``shape`` (kv heads possibly replicated; no dropout, no fusions;
    ``calculate_per_token_loss``: the engine scales its losses itself)."""
    from megatron.core.transformer import TransformerConfig

    check_megatron(shape, dims.tp, dims.pp)
    if shape.num_heads % dims.tp:
        raise ConfigError(f"rl.actor.megatron.tp={dims.tp} does not divide the model's "
                          f"{shape.num_heads} attention heads")
    scaling = getattr(hf, "rope_scaling", None) or getattr(hf, "rope_parameters", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ConfigError("megatron engine: rope_scaling is not mapped (plain RoPE only)")
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim, ffn_hidden_size=shape.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=float(hf.rms_norm_eps),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        pipeline_dtype=torch.bfloat16 if mixed else params_dtype,
        params_dtype=params_dtype, bf16=mixed, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        bias_dropout_fusion=False, calculate_per_token_loss=True, batch_p2p_sync=False,
        qk_layernorm=shape.qk_norm,
        deallocate_pipeline_outputs=False, init_method_std=float(hf.initializer_range))


def rope_base(hf: Any) -> float:
    base = getattr(hf, "rope_theta", None)
    if base is None:  # transformers 5 keeps it under rope_parameters
        base = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(base)


def build_gpt(hf: Any, cfg: Any, spec: Any, head: str) -> torch.nn.Module:
    """This rank's stage of ``GPTModel``. ``head="value"``: the output layer has one column (and
    bias) per tp rank, of which the value is the first (the critic; HF's ``score`` head of a
    ``*ForTokenClassification`` with one label)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    tp = cfg.tensor_model_parallel_size
    shape = ModelShape.from_hf(hf)
    tied = shape.tie_word_embeddings and head == "lm"
    model = GPTModel(config=cfg, transformer_layer_spec=spec,
                     vocab_size=padded_vocab(shape.vocab_size, tp),
                     max_sequence_length=int(hf.max_position_embeddings),
                     pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=tied,
                     position_embedding_type="rope", rotary_base=int(rope_base(hf)))
    if head == "value" and ps.is_pipeline_last_stage():
        model.output_layer = tensor_parallel.ColumnParallelLinear(
            shape.hidden_size, tp, config=cfg, init_method=cfg.init_method, bias=True,
            skip_bias_add=False, gather_output=False)
    return model


def wrap_ddp(model: torch.nn.Module, cfg: Any) -> Any:
    """megatron's DDP with the distributed optimizer's buffers; gradients accumulate and reduce
    in float32."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                            overlap_grad_reduce=False,
                                            use_distributed_optimizer=True,
                                            average_in_collective=False)
    return DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)


def build_optimizer(ddp: Any, lr: float, weight_decay: float, betas: tuple[float, float],
                    grad_clip: float, mixed: bool) -> Any:
    """megatron's DistributedOptimizer (AdamW on this rank's float32 shard of the data-parallel
    group's parameters; under mixed precision those are the float32 masters of bfloat16
    parameters). Clipping at ``grad_clip`` (0: a bound nothing reaches, so the norm is still
    measured)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay,
                              adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=1e-8,
                              use_distributed_optimizer=True, bf16=mixed,
                              params_dtype=torch.bfloat16 if mixed else torch.float32,
                              clip_grad=grad_clip if grad_clip > 0 else 1e30)
    return get_megatron_optimizer(opt_cfg, [ddp])
