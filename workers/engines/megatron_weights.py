"""Hugging Face weights in and out of a megatron rank, through the mapping of
:mod:`system.reshard.megatron` (fused QKV per query group, ``linear_fc1`` = gate/up per TP shard,
padded vocabulary, per-stage layer indices).

One extension lives here: a model with fewer key/value heads than ``tp`` (arith-tiny has one)
is loaded with each kv head *replicated* ``tp / kv_heads`` times (megatron splits ``linear_qkv``
by whole query groups), as vLLM does. The copies start equal and stay equal: their gradients
are summed over the tensor-parallel ranks that hold copies of one head
(:func:`sync_replicated_kv_grads`) before the optimizer step, so every copy takes the same
update, and the optimizer's gradient norm (clipping) counts one copy of each head
(:func:`count_kv_copies_once`); on export the first copy of each head is the HF head.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from system.reshard.megatron import (hf_to_megatron_shard, megatron_local_params,
                                     megatron_shards_to_hf, local_box)
from system.reshard.params import Box, ModelShape
from system.errors import ConfigError

VOCAB_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def kv_replicas(shape: ModelShape, tp: int) -> int:
    """How many copies of each kv head megatron holds (1 unless ``tp`` exceeds the kv heads)."""
    if tp <= shape.num_kv_heads:
        return 1
    if tp % shape.num_kv_heads:
        raise ConfigError(f"rl.actor.megatron.tp={tp} is not a multiple of the model's "
                          f"{shape.num_kv_heads} kv heads")
    if shape.num_heads % tp:
        raise ConfigError(f"rl.actor.megatron.tp={tp} does not divide the model's "
                          f"{shape.num_heads} attention heads")
    return tp // shape.num_kv_heads


def megatron_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The shape megatron is built with: kv heads replicated up to ``tp`` where needed."""
    return dataclasses.replace(shape, num_kv_heads=shape.num_kv_heads * kv_replicas(shape, tp))


def _is_kv(name: str) -> bool:
    return ".self_attn.k_proj." in name or ".self_attn.v_proj." in name


def expand_kv(hf: Mapping[str, torch.Tensor], shape: ModelShape, rep: int
              ) -> dict[str, torch.Tensor]:
    """HF tensors with each kv head repeated ``rep`` times (head ``j`` of the result is head
    ``j // rep``)."""
    if rep == 1:
        return dict(hf)
    out = dict(hf)
    for name, t in hf.items():
        if _is_kv(name):
            heads = t.reshape(shape.num_kv_heads, shape.head_dim, *t.shape[1:])
            out[name] = heads.repeat_interleave(rep, dim=0).reshape(-1, *t.shape[1:])
    return out


def collapse_kv(hf: Mapping[str, torch.Tensor], shape: ModelShape, rep: int
                ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`expand_kv`: the first copy of every head."""
    if rep == 1:
        return dict(hf)
    out = dict(hf)
    for name, t in hf.items():
        if _is_kv(name):
            heads = t.reshape(shape.num_kv_heads * rep, shape.head_dim, *t.shape[1:])
            out[name] = heads[::rep].reshape(-1, *t.shape[1:]).clone()
    return out


def local_from_hf(hf: Mapping[str, torch.Tensor], shape: ModelShape, tp: int, tp_rank: int,
                  pp: int, pp_rank: int, head: str = "lm") -> dict[str, torch.Tensor]:
    """This rank's megatron state dict (local-spec names) from a full HF state dict (``head``:
    the output layer's, :data:`system.reshard.megatron.HEADS`)."""
    rep = kv_replicas(shape, tp)
    return hf_to_megatron_shard(expand_kv(hf, shape, rep), megatron_shape(shape, tp), tp,
                                tp_rank, pp, pp_rank, head=head)


def hf_from_shards(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                   shape: ModelShape, tp: int, pp: int, head: str = "lm"
                   ) -> dict[str, torch.Tensor]:
    """The full HF state dict from every rank's megatron state dict ``shards[(tp, pp)]``."""
    rep = kv_replicas(shape, tp)
    hf = megatron_shards_to_hf(shards, megatron_shape(shape, tp), tp, pp, head=head)
    return collapse_kv(hf, shape, rep)


def critic_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What a critic's ``config.json`` says beyond its model's (``cfg``): the architecture and
    the one label of Hugging Face's ``*ForTokenClassification``, as ``save_pretrained`` of the
    FSDP engine's critic writes them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    arch = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(str(cfg.get("model_type")))
    out: dict[str, Any] = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    if arch:
        out["architectures"] = [arch]
    return out


def sync_replicated_kv_grads(model: torch.nn.Module, shape: ModelShape, tp: int) -> None:
    """Sum the gradients (``main_grad``, megatron DDP's buffer) of the replicated k/v rows of
    ``linear_qkv`` over the tensor-parallel ranks holding copies of the same head. Collective
    over the tensor-parallel group; nothing happens without replication."""
    rep = kv_replicas(shape, tp)
    if rep == 1:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()
    hn, qpg = shape.head_dim, shape.num_heads // tp  # one query group per rank
    for name, p in model.named_parameters():
        # the fused QKV weight and bias only (Transformer Engine's layer spec also puts the
        # attention's input norm there, as linear_qkv.layer_norm_weight: the same on every rank)
        if (not name.endswith(("linear_qkv.weight", "linear_qkv.bias"))
                or getattr(p, "main_grad", None) is None):
            continue
        kv = p.main_grad[qpg * hn:(qpg + 2) * hn]  # this rank's k head, then its v head
        parts = [torch.empty_like(kv) for _ in range(tp)]
        dist.all_gather(parts, kv.contiguous(), group=group)
        first = tp_rank - tp_rank % rep
        kv.copy_(sum(parts[first + i] for i in range(rep)))


def count_kv_copies_once(optimizer: Any, model: torch.nn.Module, shape: ModelShape, tp: int
                         ) -> None:
    """Make the gradient norm of megatron's optimizer (``optimizer``: a ``DistributedOptimizer``
    or a ``ChainedOptimizer`` of them, over ``model``, the unwrapped stage) count every
    replicated kv head once, as at tp=1 and in the FSDP engine.

    megatron sums the squares of each tensor-parallel rank's ``linear_qkv`` shard over the whole
    world (the fused weight is split, not a "duplicate"), so without this each of the ``rep``
    equal copies of a kv head's rows (:func:`sync_replicated_kv_grads`) would add its square
    once. Here every tp rank but the first of each head's ``rep`` ranks leaves its k/v rows out
    of the list of gradients the norm is taken over (``get_main_grads_for_grad_norm``, which
    both the optimizer's and ``ChainedOptimizer``'s clipping use); clipping itself still scales
    every gradient, copies included, by the one coefficient. Works on the optimizer's float32
    main-gradient shards (1-D slices of the parameters' flattened ``main_grad``, each covering
    ``param_range`` of its parameter), so any data-parallel sharding and bf16 parameters are
    handled. Nothing happens without replication or on a rank whose copies count."""
    rep = kv_replicas(shape, tp)
    if rep == 1:
        return
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_rank() % rep == 0:  # the first copy of its head: counts
        return
    hn, qpg = shape.head_dim, shape.num_heads // tp  # one query group per rank
    skip: dict[int, tuple[int, int]] = {}  # id(model param) -> flat range of its k/v rows
    for name, p in model.named_parameters():
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")) and p.requires_grad:
            row = p[0].numel() if p.dim() > 1 else 1
            skip[id(p)] = (qpg * hn * row, (qpg + 2) * hn * row)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if (not hasattr(opt, "shard_fp32_from_float16_groups")
                or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
            raise NotImplementedError("replicated kv heads need megatron's DistributedOptimizer "
                                      "with float32 main gradients")
        # the optimizer's main params (fp32 shards) and where they lie in their model params
        drop: list[tuple[torch.Tensor, int, int]] = []
        for model_groups, main_groups in ((opt.model_float16_groups,
                                           opt.shard_fp32_from_float16_groups),
                                          (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for model_group, main_group in zip(model_groups, main_groups):
                for mp, main in zip(model_group, main_group):
                    if id(mp) not in skip:
                        continue
                    r = opt._get_model_param_range_map(mp)["param"]
                    a, b = max(skip[id(mp)][0], r.start), min(skip[id(mp)][1], r.end)
                    if a < b:
                        drop.append((main, a - r.start, b - r.start))
        if drop:
            opt.get_main_grads_for_grad_norm = _without_rows(opt.get_main_grads_for_grad_norm,
                                                              drop)


def _without_rows(grads_for_norm: Any, drop: list[tuple[torch.Tensor, int, int]]) -> Any:
    """``grads_for_norm`` (megatron's method) with the flat range ``[a, b)`` of each main
    param's gradient in ``drop`` cut out (the gradients are read at call time: megatron sets
    new ones every step)."""
    def grads() -> list[torch.Tensor]:
        cut = {id(main.grad): (a, b) for main, a, b in drop if main.grad is not None}
        out: list[torch.Tensor] = []
        for g in grads_for_norm():
            if id(g) not in cut:
                out.append(g)
                continue
            a, b = cut[id(g)]
            flat = g.view(-1)
            out.extend(part for part in (flat[:a], flat[b:]) if part.numel())
        return out
    return grads


def publish_boxes(local: Mapping[str, torch.Tensor], boxes: Mapping[str, Box],
                  shape: ModelShape, tp: int, tp_rank: int, pp: int, pp_rank: int,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF-named boxes ``boxes`` (the reshard planner's view of this rank: its tp shard of
    its stage) cut from this rank's megatron tensors ``local``. Nothing is gathered but the
    vocabulary tensors, whose padded megatron rows differ from the planner's even split: those
    are all-gathered over the tensor-parallel group (collective there)."""
    mshape = megatron_shape(shape, tp)
    where: dict[str, list[tuple[str, Any]]] = {}  # HF name -> [(megatron name, piece)]
    rep, hn = kv_replicas(shape, tp), shape.head_dim
    for p in megatron_local_params(mshape, tp, tp_rank, pp, pp_rank):
        for piece in p.pieces:
            if rep > 1 and _is_kv(piece.source):  # copy of head j // rep of the HF tensor
                (a, b), rest = piece.box[0], piece.box[1:]
                head = a // hn // rep
                piece = dataclasses.replace(piece, box=((head * hn, head * hn + b - a), *rest))
            where.setdefault(piece.source, []).append((p.name, piece))
    out: dict[str, torch.Tensor] = {}
    for name, box in boxes.items():
        if name in VOCAB_NAMES:
            full = _gather_vocab(local, name, where, shape, tp)
            t = full[tuple(slice(a, b) for a, b in box)]
        else:
            t = _assemble(local, name, box, where.get(name, []), (tp_rank, pp_rank))
        out[name] = t.detach().to(dtype).contiguous()
    return out


def _assemble(local: Mapping[str, torch.Tensor], name: str, box: Box,
              pieces: list[tuple[str, Any]], rank: tuple[int, int]) -> torch.Tensor:
    """``box`` of HF tensor ``name`` from the pieces of it this rank holds (one per query group
    for q/k/v): each piece lies wholly inside the box or outside it."""
    first = local[pieces[0][0]] if pieces else None
    t = torch.empty(tuple(b - a for a, b in box), dtype=first.dtype if first is not None
                    else torch.float32, device=first.device if first is not None else "cpu")
    covered = 0
    for mname, piece in pieces:
        if any(pa < a or pb > b for (pa, pb), (a, b) in zip(piece.box, box)):
            continue
        region = tuple(slice(pa - a, pb - a) for (pa, pb), (a, _) in zip(piece.box, box))
        t[region] = local[mname][tuple(slice(a, b) for a, b in local_box(piece))]
        covered += t[region].numel()
    if covered != t.numel():
        raise RuntimeError(f"{name}: megatron rank tp={rank[0]}, pp={rank[1]} does not hold "
                           f"the box {box} the plan gives it")
    return t


def _gather_vocab(local: Mapping[str, torch.Tensor], name: str,
                  where: Mapping[str, list[tuple[str, Any]]], shape: ModelShape, tp: int
                  ) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mname = "embedding.word_embeddings.weight" if name == VOCAB_NAMES[0] else "output_layer.weight"
    if name in where:
        mname = where[name][0][0]
    t = local[mname].detach()
    if tp == 1:
        return t[:shape.vocab_size]
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts)[:shape.vocab_size]
