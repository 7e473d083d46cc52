"""The mapping between Hugging Face Qwen2/Llama/Qwen3 parameters and megatron-core ``GPTModel``
shards (local spec), owned here so that the engine, its checkpoint import/export and the reshard
planner share one description.

A megatron rank (tp rank ``r`` of ``tp``, pipeline stage ``s`` of ``pp``) holds:

- ``embedding.word_embeddings.weight`` (first stage) and ``output_layer.weight`` (last stage;
  with tied embeddings only when pp > 1, where it is the last stage's copy of the embedding):
  rows ``[r * Vp / tp, (r + 1) * Vp / tp)`` of the vocabulary padded to ``Vp``, a multiple of
  ``vocab_divisible_by * tp`` (as megatron pads it); padding rows hold no HF data (zeros);
- per layer (indices restart at 0 on every stage; layers split evenly over stages):
  ``self_attention.linear_qkv.{weight,bias}``: rows grouped per query group ``g`` of this
  rank's ``ng / tp`` groups: the group's ``np / ng`` q heads, then k head ``g``, then v head
  ``g``; ``linear_proj``/``linear_fc2``: the input dimension split; ``mlp.linear_fc1.weight``:
  ``cat(gate.chunk(tp)[r], up.chunk(tp)[r])``; ``input_layernorm``/``pre_mlp_layernorm``
  replicated; Qwen3's per-head ``q_norm``/``k_norm`` (one head's weights, shared by every head)
  are ``self_attention.q_layernorm``/``k_layernorm``, replicated;
- ``decoder.final_layernorm.weight`` (last stage), replicated.

A critic (``head="value"``) has no LM head: its last stage's ``output_layer`` is a value head of
one column per tp rank (``weight`` ``(1, h)`` and ``bias`` ``(1,)`` on each), of which tp rank
0's is the value. It maps to the ``score`` head of Hugging Face's ``*ForTokenClassification``
with one label (what the FSDP engine's critic saves); the other ranks' columns hold no HF data.

:func:`megatron_local_params` describes this as data (which box of which HF tensor lies where in
each local tensor, the planner's input); :func:`hf_to_megatron_shard` and
:func:`megatron_shards_to_hf` apply that description to tensors. Pure: torch only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from system.reshard.layout import LayoutError
from system.reshard.params import Box, DstParam, ModelShape, Piece, qwen2_specs

if TYPE_CHECKING:  # torch loads where tensors are made (the worker entry point stays light)
    import torch

VOCAB_DIVISIBLE_BY = 128  # megatron's default make_vocab_size_divisible_by


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """The vocabulary size megatron allocates: ``vocab_size`` rounded up to a multiple of
    ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_megatron(shape: ModelShape, tp: int, pp: int) -> None:
    """Refuse, with one line, a split megatron cannot make of ``shape``."""
    if tp < 1 or pp < 1:
        raise LayoutError(f"megatron tp={tp}, pp={pp} must be >= 1")
    if shape.num_heads % shape.num_kv_heads:
        raise LayoutError(f"megatron: {shape.num_heads} attention heads are not a multiple of "
                          f"{shape.num_kv_heads} query groups (kv heads)")
    if shape.num_kv_heads % tp:
        raise LayoutError(f"megatron tp={tp} does not divide the {shape.num_kv_heads} query "
                          "groups (kv heads): linear_qkv is split by whole groups")
    if shape.intermediate_size % tp:
        raise LayoutError(f"megatron tp={tp} does not divide intermediate_size "
                          f"{shape.intermediate_size}")
    if shape.num_layers % pp:
        raise LayoutError(f"megatron pp={pp} does not divide the model's {shape.num_layers} "
                          "layers (uneven pipeline stages are not supported)")


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The global layer indices stage ``pp_rank`` holds (even split)."""
    n = num_layers // pp
    return range(pp_rank * n, (pp_rank + 1) * n)


def _rows(lo: int, hi: int, full: tuple[int, ...]) -> Box:
    return ((lo, hi),) + tuple((0, n) for n in full[1:])


def _vocab_param(name: str, source: str, shape: ModelShape, tp: int, r: int,
                 divisible_by: int) -> DstParam:
    per = padded_vocab(shape.vocab_size, tp, divisible_by) // tp
    lo, hi = r * per, min((r + 1) * per, shape.vocab_size)
    full = (shape.vocab_size, shape.hidden_size)
    pieces = (Piece(source, _rows(lo, hi, full), 0, 0),) if lo < hi else ()
    return DstParam(name, (per, shape.hidden_size), pieces)


def _qkv_param(name: str, hf: str, shape: ModelShape, tp: int, r: int, suffix: str) -> DstParam:
    """``linear_qkv.{suffix}``: per query group, its q heads, its k head, its v head."""
    hn, ng = shape.head_dim, shape.num_kv_heads
    qpg = shape.num_heads // ng
    h = (shape.hidden_size,) if suffix == "weight" else ()
    q_full, kv_full = (shape.num_heads * hn,) + h, (ng * hn,) + h
    pieces, off = [], 0
    for g in range(r * ng // tp, (r + 1) * ng // tp):
        for part, lo, n, full in (("q_proj", g * qpg * hn, qpg * hn, q_full),
                                  ("k_proj", g * hn, hn, kv_full),
                                  ("v_proj", g * hn, hn, kv_full)):
            pieces.append(Piece(f"{hf}self_attn.{part}.{suffix}", _rows(lo, lo + n, full), 0, off))
            off += n
    return DstParam(name, (off,) + h, tuple(pieces))


def _layer_params(shape: ModelShape, tp: int, r: int, i: int, local: int) -> list[DstParam]:
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
    h, inter, q = shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim
    ic, qc = inter // tp, q // tp
    out = [DstParam(mg + "input_layernorm.weight", (h,),
                    (Piece(hf + "input_layernorm.weight", ((0, h),), 0, 0),)),
           _qkv_param(mg + "self_attention.linear_qkv.weight", hf, shape, tp, r, "weight")]
    if shape.qkv_bias:
        out.append(_qkv_param(mg + "self_attention.linear_qkv.bias", hf, shape, tp, r, "bias"))
    if shape.qk_norm:
        hn = shape.head_dim
        out += [DstParam(f"{mg}self_attention.{part[0]}_layernorm.weight", (hn,),
                         (Piece(f"{hf}self_attn.{part}.weight", ((0, hn),), 0, 0),))
                for part in ("q_norm", "k_norm")]
    out += [
        DstParam(mg + "self_attention.linear_proj.weight", (h, qc),
                 (Piece(hf + "self_attn.o_proj.weight", ((0, h), (r * qc, (r + 1) * qc)), 1, 0),)),
        DstParam(mg + "pre_mlp_layernorm.weight", (h,),
                 (Piece(hf + "post_attention_layernorm.weight", ((0, h),), 0, 0),)),
        DstParam(mg + "mlp.linear_fc1.weight", (2 * ic, h),
                 (Piece(hf + "mlp.gate_proj.weight", _rows(r * ic, (r + 1) * ic, (inter, h)), 0, 0),
                  Piece(hf + "mlp.up_proj.weight", _rows(r * ic, (r + 1) * ic, (inter, h)), 0,
                        ic))),
        DstParam(mg + "mlp.linear_fc2.weight", (h, ic),
                 (Piece(hf + "mlp.down_proj.weight", ((0, h), (r * ic, (r + 1) * ic)), 1, 0),)),
    ]
    return out


HEADS = ("lm", "value")
"""What the last stage's output layer is: the causal LM's (actor, reference) or a critic's
value head."""

VALUE_HEAD = ("score.weight", "score.bias")
"""The HF names of a critic's value head (``*ForTokenClassification``, one label)."""


def _value_head(shape: ModelShape, tp_rank: int) -> list[DstParam]:
    h = shape.hidden_size
    mine = tp_rank == 0  # (the other ranks' columns: no HF data)
    return [DstParam("output_layer.weight", (1, h),
                     (Piece(VALUE_HEAD[0], ((0, 1), (0, h)), 0, 0),) if mine else ()),
            DstParam("output_layer.bias", (1,),
                     (Piece(VALUE_HEAD[1], ((0, 1),), 0, 0),) if mine else ())]


def megatron_local_params(shape: ModelShape, tp: int, tp_rank: int, pp: int, pp_rank: int,
                          vocab_divisible_by: int = VOCAB_DIVISIBLE_BY, head: str = "lm"
                          ) -> list[DstParam]:
    """Every tensor megatron rank (``tp_rank``, ``pp_rank``) holds, by its megatron name, with
    the boxes of HF tensors it is made of (``Piece.dim``/``offset``: where each box starts in
    the local tensor). Rows of padded vocabulary belong to no piece. ``head``: see
    :data:`HEADS`."""
    check_megatron(shape, tp, pp)
    if head not in HEADS:
        raise LayoutError(f"megatron head={head!r} is not one of {', '.join(HEADS)}")
    if not (0 <= tp_rank < tp and 0 <= pp_rank < pp):
        raise LayoutError(f"megatron rank tp={tp_rank}, pp={pp_rank} outside tp={tp}, pp={pp}")
    first, last = pp_rank == 0, pp_rank == pp - 1
    out: list[DstParam] = []
    if first:
        out.append(_vocab_param("embedding.word_embeddings.weight", "model.embed_tokens.weight",
                                shape, tp, tp_rank, vocab_divisible_by))
    layers = stage_layers(shape.num_layers, pp, pp_rank)
    for local, i in enumerate(layers):
        out += _layer_params(shape, tp, tp_rank, i, local)
    if last:
        h = shape.hidden_size
        out.append(DstParam("decoder.final_layernorm.weight", (h,),
                            (Piece("model.norm.weight", ((0, h),), 0, 0),)))
        if head == "value":
            out += _value_head(shape, tp_rank)
        elif not shape.tie_word_embeddings:
            out.append(_vocab_param("output_layer.weight", "lm_head.weight", shape, tp, tp_rank,
                                    vocab_divisible_by))
        elif not first:  # tied, pp > 1: the last stage keeps its own copy of the embedding
            out.append(_vocab_param("output_layer.weight", "model.embed_tokens.weight", shape, tp,
                                    tp_rank, vocab_divisible_by))
    return out


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def local_box(piece: Piece) -> Box:
    """Where ``piece`` lies in its local tensor."""
    return tuple((piece.offset, piece.offset + b - a) if d == piece.dim else (0, b - a)
                 for d, (a, b) in enumerate(piece.box))


def hf_to_megatron_shard(hf_state: Mapping[str, torch.Tensor], shape: ModelShape, tp: int,
                         tp_rank: int, pp: int, pp_rank: int,
                         vocab_divisible_by: int = VOCAB_DIVISIBLE_BY, head: str = "lm"
                         ) -> dict[str, torch.Tensor]:
    """Megatron rank (``tp_rank``, ``pp_rank``)'s state dict from a full HF state dict (padded
    vocabulary rows, and a value head's columns but the first, are zero). New tensors: nothing
    aliases ``hf_state``."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for p in megatron_local_params(shape, tp, tp_rank, pp, pp_rank, vocab_divisible_by, head):
        ref = hf_state[p.pieces[0].source] if p.pieces else hf_state["model.embed_tokens.weight"]
        t = torch.zeros(p.shape, dtype=ref.dtype, device=ref.device)
        for piece in p.pieces:
            t[_slices(local_box(piece))] = hf_state[piece.source][_slices(piece.box)]
        out[p.name] = t
    return out


def hf_shapes(shape: ModelShape, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Every HF tensor of the model with ``head`` (:data:`HEADS`) and its shape: a critic has
    the value head instead of ``lm_head``."""
    out = {s.name: s.shape for s in qwen2_specs(shape)}
    if head == "value":
        out.pop("lm_head.weight", None)
        out.update({VALUE_HEAD[0]: (1, shape.hidden_size), VALUE_HEAD[1]: (1,)})
    return out


def megatron_shards_to_hf(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]],
                          shape: ModelShape, tp: int, pp: int,
                          vocab_divisible_by: int = VOCAB_DIVISIBLE_BY, head: str = "lm"
                          ) -> dict[str, torch.Tensor]:
    """The full HF state dict from every rank's shard: ``shards[(tp_rank, pp_rank)]`` is that
    rank's megatron state dict. Copies of one HF region on several ranks (replicated norms, the
    tied embedding's last-stage copy) must agree exactly, else ``ValueError``."""
    import torch

    shapes = hf_shapes(shape, head)
    dtype = next(iter(next(iter(shards.values())).values())).dtype
    hf = {name: torch.empty(s, dtype=dtype) for name, s in shapes.items()}
    seen = {name: torch.zeros(s, dtype=torch.bool) for name, s in shapes.items()}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            state = shards[(tp_rank, pp_rank)]
            for p in megatron_local_params(shape, tp, tp_rank, pp, pp_rank, vocab_divisible_by,
                                           head):
                for piece in p.pieces:
                    value = state[p.name][_slices(local_box(piece))]
                    box = _slices(piece.box)
                    done = seen[piece.source][box]
                    if done.any() and not torch.equal(hf[piece.source][box][done], value[done]):
                        raise ValueError(f"{p.name} on megatron rank tp={tp_rank}, pp={pp_rank} "
                                         f"disagrees with another copy of {piece.source}")
                    hf[piece.source][box] = value
                    seen[piece.source][box] = True
    for name, s in seen.items():
        if not bool(s.all()):
            raise ValueError(f"{name} is not fully covered by the megatron shards")
    return hf

