"""How each parameter of a Qwen2/Llama/Qwen3-family model is split by tensor parallelism and placed by
pipeline parallelism, in the training engine's naming (Hugging Face) and in vLLM's (which fuses
``q/k/v`` into ``qkv_proj`` and ``gate/up`` into ``gate_up_proj``).

A shard is a box (a slice per dimension) of the full tensor. :func:`tp_box` gives the box a
tensor-parallel rank holds; attention k/v use head-aware boxes, replicating kv heads when tp
exceeds their number (as vLLM does).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from system.errors import ConfigError
from system.reshard.layout import LayoutError, TrainLayout, fsdp_rows

Box = tuple[tuple[int, int], ...]  # (start, stop) per dimension


class Split(str, enum.Enum):
    COLUMN = "column"          # dim 0 (output features)
    ROW = "row"                # dim 1 (input features)
    VOCAB = "vocab"            # dim 0 of embeddings / lm_head
    REPLICATED = "replicated"
    KV_HEADS = "kv_heads"      # dim 0 by kv heads, replicated when tp > heads


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the specs need of a model config (a transformers ``Qwen2Config``, ``LlamaConfig``
    or ``Qwen3Config``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3's ``q_norm``/``k_norm``)."""

    @staticmethod
    def from_hf(cfg: object) -> "ModelShape":
        g = lambda k, d=None: getattr(cfg, k, d)  # noqa: E731
        heads = g("num_attention_heads")
        return ModelShape(
            vocab_size=g("vocab_size"), hidden_size=g("hidden_size"),
            intermediate_size=g("intermediate_size"), num_layers=g("num_hidden_layers"),
            num_heads=heads, num_kv_heads=g("num_key_value_heads") or heads,
            head_dim=g("head_dim") or g("hidden_size") // heads,
            tie_word_embeddings=bool(g("tie_word_embeddings", False)),
            qkv_bias=bool(g("attention_bias", False)) or g("model_type") == "qwen2",
            qk_norm=g("model_type") == "qwen3")

    def to_dict(self) -> dict[str, int | bool]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: object) -> "ModelShape":
        """A shape sent over the wire (:meth:`to_dict`): ValueError naming what is wrong."""
        fields = {f.name: f for f in dataclasses.fields(ModelShape)}
        if not isinstance(d, dict) or set(d) != set(fields):
            raise ValueError(f"a model shape has the keys {sorted(fields)}, got "
                             f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        for k, v in d.items():
            kind = bool if fields[k].type == "bool" else int
            if type(v) is not kind or (kind is int and v <= 0):
                raise ValueError(f"a model shape's {k} is {v!r}, not a positive {kind.__name__}"
                                 if kind is int else f"a model shape's {k} is {v!r}, not a bool")
        return ModelShape(**d)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter in Hugging Face naming."""

    name: str
    shape: tuple[int, ...]
    split: Split
    layer: int | None  # None: embeddings (first stage) or final norm / lm_head (last stage)
    last_stage: bool = False
    heads: int = 0     # for KV_HEADS: number of kv heads
    head_dim: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def qwen2_specs(m: ModelShape) -> list[ParamSpec]:
    """Every parameter of the model, in state-dict order."""
    h, q, kv, hd = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.head_dim
    specs = [ParamSpec("model.embed_tokens.weight", (m.vocab_size, h), Split.VOCAB, None)]
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        specs += [
            ParamSpec(p + "self_attn.q_proj.weight", (q, h), Split.COLUMN, i),
            ParamSpec(p + "self_attn.k_proj.weight", (kv, h), Split.KV_HEADS, i,
                      heads=m.num_kv_heads, head_dim=hd),
            ParamSpec(p + "self_attn.v_proj.weight", (kv, h), Split.KV_HEADS, i,
                      heads=m.num_kv_heads, head_dim=hd),
        ]
        if m.qkv_bias:
            specs += [
                ParamSpec(p + "self_attn.q_proj.bias", (q,), Split.COLUMN, i),
                ParamSpec(p + "self_attn.k_proj.bias", (kv,), Split.KV_HEADS, i,
                          heads=m.num_kv_heads, head_dim=hd),
                ParamSpec(p + "self_attn.v_proj.bias", (kv,), Split.KV_HEADS, i,
                          heads=m.num_kv_heads, head_dim=hd),
            ]
        if m.qk_norm:  # one head's weights, shared by every head: replicated
            specs += [ParamSpec(p + "self_attn.q_norm.weight", (hd,), Split.REPLICATED, i),
                      ParamSpec(p + "self_attn.k_norm.weight", (hd,), Split.REPLICATED, i)]
        specs += [
            ParamSpec(p + "self_attn.o_proj.weight", (h, q), Split.ROW, i),
            ParamSpec(p + "mlp.gate_proj.weight", (m.intermediate_size, h), Split.COLUMN, i),
            ParamSpec(p + "mlp.up_proj.weight", (m.intermediate_size, h), Split.COLUMN, i),
            ParamSpec(p + "mlp.down_proj.weight", (h, m.intermediate_size), Split.ROW, i),
            ParamSpec(p + "input_layernorm.weight", (h,), Split.REPLICATED, i),
            ParamSpec(p + "post_attention_layernorm.weight", (h,), Split.REPLICATED, i),
        ]
    specs.append(ParamSpec("model.norm.weight", (h,), Split.REPLICATED, None, last_stage=True))
    if not m.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (m.vocab_size, h), Split.VOCAB, None,
                               last_stage=True))
    return specs


class UnmappedWeightError(ConfigError):
    """A model has a weight that the parameter specs do not map (it would stay stale in the
    generation servers), or lacks one they expect."""


def check_mapped(specs: Sequence[ParamSpec], names: Sequence[str], who: str) -> None:
    """Refuse, in one line naming the parameter, a model whose weights ``names`` are not exactly
    the specs' (a tied ``lm_head.weight`` is the embedding's and needs no spec)."""
    known = {s.name for s in specs}
    tied = "lm_head.weight" not in known
    names = [n for n in names if not n.endswith("rotary_emb.inv_freq")]  # old checkpoints' buffer
    for name in names:
        if name not in known and not (tied and name == "lm_head.weight"):
            raise UnmappedWeightError(
                f"{who} has weight {name!r} that the weight-sync specs do not map "
                "(known families: Qwen2, Llama, Qwen3); it would stay stale in the generation "
                "servers")
    missing = sorted(known - set(names))
    if missing:
        raise UnmappedWeightError(f"{who} lacks weight {missing[0]!r} that the weight-sync specs "
                                  "expect (a model of another shape than its config?)")


def check_divisible(specs: Sequence[ParamSpec], tp: int, who: str) -> None:
    for s in specs:
        if s.split in (Split.COLUMN, Split.VOCAB) and s.shape[0] % tp:
            raise LayoutError(f"{who} tp={tp} does not divide {s.name} dim 0 ({s.shape[0]})")
        if s.split == Split.ROW and s.shape[1] % tp:
            raise LayoutError(f"{who} tp={tp} does not divide {s.name} dim 1 ({s.shape[1]})")
        if s.split == Split.KV_HEADS and s.heads % tp and tp % s.heads:
            raise LayoutError(f"{who} tp={tp} and {s.heads} kv heads of {s.name} do not divide "
                              "each other")


def tp_box(spec: ParamSpec, tp: int, rank: int) -> Box:
    """The box of ``spec``'s full tensor that tensor-parallel ``rank`` of ``tp`` holds."""
    full = tuple((0, n) for n in spec.shape)
    if spec.split == Split.REPLICATED or tp == 1:
        return full
    if spec.split in (Split.COLUMN, Split.VOCAB):
        n = spec.shape[0] // tp
        return ((rank * n, (rank + 1) * n),) + full[1:]
    if spec.split == Split.ROW:
        n = spec.shape[1] // tp
        return (full[0], (rank * n, (rank + 1) * n)) + full[2:]
    # KV_HEADS
    if spec.heads >= tp:
        n = spec.heads // tp * spec.head_dim
        return ((rank * n, (rank + 1) * n),) + full[1:]
    head = rank * spec.heads // tp  # tp > heads: each head is replicated over tp // heads ranks
    return ((head * spec.head_dim, (head + 1) * spec.head_dim),) + full[1:]


def stage_of(spec: ParamSpec, num_layers: int, pp: int) -> int:
    """Pipeline stage holding ``spec``: layers split as evenly as possible, earlier stages take
    the remainder; embeddings on the first stage, final norm and lm_head on the last."""
    if spec.layer is None:
        return pp - 1 if spec.last_stage else 0
    base, extra = divmod(num_layers, pp)
    bound = 0
    for stage in range(pp):
        bound += base + (1 if stage < extra else 0)
        if spec.layer < bound:
            return stage
    raise AssertionError("layer beyond the last stage")


# --- vLLM's naming: fused parameters made of pieces of HF parameters --------------------------

@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of a destination parameter: rows ``[offset, offset + box rows)`` of the local tensor
    along ``dim`` hold ``box`` of the HF parameter ``source``."""

    source: str
    box: Box
    dim: int
    offset: int


@dataclasses.dataclass(frozen=True)
class DstParam:
    """A parameter as one generation tp rank holds it."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def vllm_name(hf_name: str) -> str:
    for part, (fused, _) in _FUSED.items():
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{fused}.")
    return hf_name


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def vllm_local_params(specs: Sequence[ParamSpec], tp: int, rank: int) -> list[DstParam]:
    """vLLM's parameters on generation tp ``rank``: fused ones concatenate their parts' shards
    along dim 0 in q, k, v (gate, up) order."""
    grouped: dict[str, list[tuple[int, ParamSpec]]] = {}
    for s in specs:
        order = next((o for part, (_, o) in _FUSED.items() if f".{part}." in s.name), 0)
        grouped.setdefault(vllm_name(s.name), []).append((order, s))
    out = []
    for name, members in grouped.items():
        offset, pieces, shape = 0, [], None
        for _, s in sorted(members, key=lambda t: t[0]):
            box = tp_box(s, tp, rank)
            bs = box_shape(box)
            pieces.append(Piece(s.name, box, 0, offset))
            offset += bs[0]
            shape = (offset,) + bs[1:]
        out.append(DstParam(name, shape, tuple(pieces)))  # type: ignore[arg-type]
    return out


def hf_local_params(specs: Sequence[ParamSpec], tp: int, rank: int) -> list[DstParam]:
    """The same parameters without fusion (one piece each): what a training tp rank holds, and
    the naming of the ``load_weights`` fallback."""
    return [DstParam(s.name, box_shape(tp_box(s, tp, rank)), (Piece(s.name, tp_box(s, tp, rank),
                                                                      0, 0),))
            for s in specs]


def fsdp_box(box: Box, dp: int, rank: int) -> Box:
    """The dim-0 chunk of ``box`` that FSDP2 rank ``rank`` of ``dp`` holds (may be empty)."""
    return (fsdp_rows(*box[0], dp, rank),) + box[1:]


def train_shard_boxes(specs: list[ParamSpec], layout: TrainLayout, rank: int, num_layers: int
                      ) -> dict[str, Box]:
    """The box of every full parameter that training ``rank`` holds (its pp stage, tp shard,
    and with ``fsdp`` its dim-0 chunk of that shard)."""
    c = layout.coord(rank)
    out = {s.name: tp_box(s, layout.tp, c.tp) for s in specs
           if stage_of(s, num_layers, layout.pp) == c.pp}
    if layout.fsdp:
        out = {n: fsdp_box(b, layout.dp, c.dp) for n, b in out.items()}
    return out


def train_local_params(specs: list[ParamSpec], layout: TrainLayout, rank: int, num_layers: int
                       ) -> list[DstParam]:
    """What training ``rank`` holds as local tensors: its HF-named shards, one piece each (the
    planner's default source layout). With ``fsdp`` each is the rank's dim-0 chunk of its
    tensor-parallel shard; an empty chunk is a tensor holding no piece."""
    return [DstParam(name, box_shape(box),
                     (Piece(name, box, 0, 0),) if box_shape(box)[0] else ())
            for name, box in train_shard_boxes(specs, layout, rank, num_layers).items()]
