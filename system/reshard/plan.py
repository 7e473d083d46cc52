"""The pure resharding planner: (training layout, generation layout, parameter specs) -> buckets
of broadcasts.

Global ranks: training ranks ``0..S-1`` (see :class:`~system.reshard.layout.TrainLayout`), then
generation ranks ``S..S+D-1``. Every region a generation rank needs is sent once, by one
training rank that holds it, in one broadcast to every generation rank that needs the same
region (every replica, and every tp rank that holds it replicated). Senders are balanced by
bytes across the data-parallel (and replicated tensor-parallel) copies, preferring one on a
receiver's node; every region of one local parameter from the same holders gets the same sender.
A source layout is data (each training rank's local tensors with the HF boxes they hold), so an
FSDP2 source (``TrainLayout.fsdp``: dim-0 chunks instead of copies, see
:func:`~system.reshard.params.train_local_params`) or a megatron one needs no code here: regions
are cut where any holding ends, and each comes from a rank holding it.

Consecutive regions that land back to back in one local parameter of every receiver (q, k, v
into vLLM's ``qkv_proj``) form a *run*: one broadcast, received straight into that parameter and
packed only by its sender. A run (or lone region) of at least ``direct_bytes`` travels alone;
smaller ones sharing a sender and a receiver set are packed together into flat buckets.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from system.reshard.params import (Box, DstParam, ParamSpec, Piece, box_shape, check_divisible,
                                   hf_local_params, train_local_params, vllm_local_params)
from system.reshard.layout import GenLayout, LayoutError, TrainLayout


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one receiver writes a transfer: ``box`` of its local parameter ``param``."""

    rank: int
    param: str
    box: Box


@dataclasses.dataclass(frozen=True)
class Transfer:
    """``box`` of the full HF parameter ``param``, broadcast by ``sender``, which reads it from
    ``source`` (a box of one of its own local tensors: an HF-named shard, or a megatron tensor
    that fuses several HF parameters)."""

    param: str
    box: Box
    sender: int
    placements: tuple[Placement, ...]
    source: Placement

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n

    @property
    def receivers(self) -> tuple[int, ...]:
        return tuple(sorted({p.rank for p in self.placements}))


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Transfers packed into one flat buffer and broadcast on the group ``members``."""

    sender: int
    members: tuple[int, ...]  # sorted; includes the sender
    transfers: tuple[Transfer, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.transfers)


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    src: TrainLayout
    dst: GenLayout
    buckets: tuple[Bucket, ...]
    itemsize: int

    @property
    def num_src(self) -> int:
        return self.src.world_size

    def for_rank(self, rank: int) -> list[Bucket]:
        return [b for b in self.buckets if rank in b.members]

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Distinct broadcast groups, sorted (creating them in this order cannot deadlock)."""
        return sorted({b.members for b in self.buckets})

    def bytes_received(self, rank: int) -> int:
        return sum(b.numel for b in self.for_rank(rank) if b.sender != rank) * self.itemsize

    def bytes_sent(self, rank: int) -> int:
        return sum(b.numel for b in self.buckets if b.sender == rank) * self.itemsize


# A source rank's holding of part of an HF parameter: (rank, its local tensor, the piece)
_Holding = tuple[int, str, Piece]


def _holdings(src_params: Sequence[Sequence[DstParam]]) -> dict[str, list[_Holding]]:
    """Per HF parameter, every source rank's local tensor piece of it."""
    out: dict[str, list[_Holding]] = {}
    for rank, params in enumerate(src_params):
        for p in params:
            for piece in p.pieces:
                out.setdefault(piece.source, []).append((rank, p.name, piece))
    return out


def _inside(inner: Box, outer: Box) -> bool:
    return all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(inner, outer))


def _units(name: str, need: Box, holdings: Sequence[_Holding]) -> list[tuple[Box,
                                                                           list[_Holding]]]:
    """Partition ``need`` into regions, each with the source holdings that contain all of it:
    cut at every holding's bounds, then merge neighbours held by the same pieces."""
    cuts = []
    for d, (lo, hi) in enumerate(need):
        cuts.append(sorted({lo, hi} | {c for _, _, pc in holdings for c in pc.box[d]
                                       if lo < c < hi}))
    units: list[tuple[Box, list[_Holding]]] = []
    for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
        box: Box = tuple(cell)
        holders = [h for h in holdings if _inside(box, h[2].box)]
        if not holders:
            raise AssertionError(f"no source holds {name}{list(box)}")
        if units and units[-1][1] == holders and _adjacent(units[-1][0], box):
            prev = units[-1][0]
            units[-1] = (tuple((min(a, c), max(b, e)) for (a, b), (c, e) in zip(prev, box)),
                         holders)
        else:
            units.append((box, holders))
    return units


def _adjacent(a: Box, b: Box) -> bool:
    """Whether ``b`` continues ``a`` along exactly one dimension (equal in the others)."""
    diff = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
    return len(diff) == 1 and a[diff[0]][1] == b[diff[0]][0]


def _chunks(box: Box, max_numel: int) -> list[Box]:
    """Split ``box`` along dim 0 so each chunk has at most ``max_numel`` elements (one row at
    least)."""
    shape = box_shape(box)
    row = 1
    for s in shape[1:]:
        row *= s
    rows = max(1, max_numel // max(row, 1))
    lo, hi = box[0]
    if hi - lo <= rows:
        return [box]
    return [((a, min(a + rows, hi)),) + box[1:] for a in range(lo, hi, rows)]


# (hf param, region) -> (source holdings containing it, where every receiver writes it)
_Needs = dict[tuple[str, Box], tuple[list["_Holding"], list[Placement]]]
# (receiver, local param) -> that local parameter's shape
_Shapes = dict[tuple[int, str], tuple[int, ...]]
# (sender, receivers) -> runs, in transfer order
_Runs = dict[tuple[int, tuple[int, ...]], list[list[Transfer]]]


def _box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _check_layouts(src: TrainLayout, dst: GenLayout, specs: Sequence[ParamSpec],
                   num_layers: int, check_src: bool) -> None:
    if max(src.tp, dst.tp) % min(src.tp, dst.tp):
        raise LayoutError(f"tensor-parallel sizes do not divide each other: training tp={src.tp}, "
                          f"generation tp={dst.tp}")
    if check_src:
        check_divisible(specs, src.tp, "training")
    check_divisible(specs, dst.tp, "generation")
    if src.pp > num_layers:
        raise LayoutError(f"pp={src.pp} is more than the model's {num_layers} layers")


def _local_box(box: Box, piece: Piece) -> Box:
    """Where ``box`` (a region inside ``piece.box`` of the HF parameter) lands in the local
    tensor that holds ``piece``."""
    return tuple(
        (a - n0 + (piece.offset if d == piece.dim else 0),
         b - n0 + (piece.offset if d == piece.dim else 0))
        for d, ((a, b), (n0, _)) in enumerate(zip(box, piece.box)))


def _destination_needs(src: TrainLayout, dst: GenLayout, specs: Sequence[ParamSpec],
                       holdings: dict[str, list[_Holding]], fused: bool
                       ) -> tuple[_Needs, _Shapes]:
    """Phase 1: which regions each destination tp rank needs, with the source holdings that
    contain each, and the shape of every receiver's local parameters.

    Regions are keyed by (HF param, box) so that every replica, and every destination tp rank
    holding the same region, share one entry and hence one broadcast.
    """
    S = src.world_size
    local = vllm_local_params if fused else hf_local_params
    needs: _Needs = {}
    shapes: _Shapes = {}
    for u in range(dst.tp):
        params: list[DstParam] = local(specs, dst.tp, u)
        for p in params:
            for replica in range(dst.replicas):
                shapes[(S + dst.rank(replica, u), p.name)] = p.shape
            for piece in p.pieces:
                for box, holders in _units(piece.source, piece.box, holdings[piece.source]):
                    local_box = _local_box(box, piece)
                    entry = needs.setdefault((piece.source, box), (holders, []))
                    for replica in range(dst.replicas):
                        entry[1].append(Placement(S + dst.rank(replica, u), p.name, local_box))
    return needs, shapes


def _choose_senders(src: TrainLayout, needs: _Needs, cap: int, src_nodes: Sequence[str],
                    dst_nodes: Sequence[str]) -> list[Transfer]:
    """Phase 2: one sender per region, balanced by bytes, same node preferred; each region is
    cut into chunks of at most ``cap`` elements.

    The choice is made per (local parameter, holding ranks), not per region, so that all
    regions of one local parameter from the same holders share a sender and can form one run.
    """
    S = src.world_size
    load = [0] * S
    chosen: dict[tuple[str, tuple[int, ...]], int] = {}
    transfers: list[Transfer] = []
    for (name, box), (holdings, placements) in needs.items():
        holders = sorted({h[0] for h in holdings})
        key = (placements[0].param, tuple(holders))
        if key not in chosen:
            recv_nodes = {dst_nodes[p.rank - S] for p in placements}
            near = [r for r in holders if src_nodes[r] in recv_nodes]
            chosen[key] = min(near or holders, key=lambda r: (load[r], r))
        sender = chosen[key]
        _, local, piece = next(h for h in holdings if h[0] == sender)
        source = Placement(sender, local, _local_box(box, piece))
        load[sender] += _box_numel(box)
        for chunk in _chunks(box, cap):
            transfers.append(Transfer(name, chunk, sender, tuple(
                Placement(p.rank, p.param, _shift(p.box, box, chunk)) for p in placements),
                Placement(sender, local, _shift(source.box, box, chunk))))
    return transfers


def _form_runs(transfers: Sequence[Transfer], shapes: _Shapes, itemsize: int, direct_bytes: int,
               cap: int) -> _Runs:
    """Phase 3: group consecutive transfers (each under ``direct_bytes``, together at most
    ``cap`` elements) that land back to back in one local parameter of every receiver; a run is
    received in place and packed only by its sender."""
    runs: _Runs = {}
    for t in transfers:
        rs = runs.setdefault((t.sender, t.receivers), [])
        last = rs[-1] if rs else None
        if (last is not None and max(t.numel, last[-1].numel) * itemsize < direct_bytes
                and sum(x.numel for x in last) + t.numel <= cap
                and _follows(last[-1], t, shapes)):
            last.append(t)
        else:
            rs.append([t])
    return runs


def _pack_buckets(runs: _Runs, itemsize: int, direct_bytes: int, cap: int
                  ) -> dict[int, list[Bucket]]:
    """Phase 4: per sender, its buckets: a run of at least ``direct_bytes`` travels alone;
    smaller runs to one receiver set are packed together, up to ``cap`` elements."""
    per_sender: dict[int, list[Bucket]] = {}
    for (sender, receivers), rs in runs.items():
        members = tuple(sorted({sender, *receivers}))
        out = per_sender.setdefault(sender, [])
        packed: list[Transfer] = []
        for run in rs:
            n = sum(x.numel for x in run)
            if n * itemsize >= direct_bytes:
                out.append(Bucket(sender, members, tuple(run)))
                continue
            if packed and sum(x.numel for x in packed) + n > cap:
                out.append(Bucket(sender, members, tuple(packed)))
                packed = []
            packed.extend(run)
        if packed:
            out.append(Bucket(sender, members, tuple(packed)))
    return per_sender


def _interleave(per_sender: dict[int, list[Bucket]]) -> list[Bucket]:
    """Round-robin over senders in rank order, so that consecutive buckets come from different
    senders and their broadcasts can overlap."""
    ordered: list[Bucket] = []
    queues = [list(per_sender[s]) for s in sorted(per_sender)]
    while any(queues):
        for q in queues:
            if q:
                ordered.append(q.pop(0))
    return ordered


def plan_reshard(src: TrainLayout, dst: GenLayout, specs: Sequence[ParamSpec], num_layers: int, *,
                 itemsize: int = 4, bucket_bytes: int = 256 << 20, direct_bytes: int = 1 << 20,
                 fused: bool = True, src_nodes: Sequence[str] | None = None,
                 dst_nodes: Sequence[str] | None = None,
                 src_params: Sequence[Sequence[DstParam]] | None = None) -> ReshardPlan:
    """Plan the transfer of every parameter from ``src`` to ``dst``.

    ``fused``: destinations hold vLLM's fused parameters (``qkv_proj``, ``gate_up_proj``);
    otherwise HF-named shards. ``direct_bytes``: a region at least this large travels alone, so
    that it can be sent from, and received into, the tensors themselves without packing.
    ``src_nodes``/``dst_nodes``: the node of each rank (for the same-node preference); default:
    all on one node. ``src_params``: the local tensors of every training rank, with the HF
    boxes they hold (e.g. :func:`~system.reshard.megatron.megatron_local_params`, already
    validated); default: HF-named tensor-parallel shards of the pipeline stage
    (:func:`~system.reshard.params.train_local_params`). Each sender reads its regions straight
    from its own local tensors: nothing is gathered.
    """
    _check_layouts(src, dst, specs, num_layers, check_src=src_params is None)
    if src_params is None:
        src_params = [train_local_params(specs, src, r, num_layers)
                      for r in range(src.world_size)]
    if len(src_params) != src.world_size:
        raise LayoutError(f"{len(src_params)} source ranks' parameters for {src} "
                          f"({src.world_size} ranks)")
    src_nodes = list(src_nodes or ["node0"] * src.world_size)
    dst_nodes = list(dst_nodes or ["node0"] * dst.world_size)
    cap = max(1, bucket_bytes // itemsize)
    needs, shapes = _destination_needs(src, dst, specs, _holdings(src_params), fused)
    transfers = _choose_senders(src, needs, cap, src_nodes, dst_nodes)
    runs = _form_runs(transfers, shapes, itemsize, direct_bytes, cap)
    buckets = _interleave(_pack_buckets(runs, itemsize, direct_bytes, cap))
    return ReshardPlan(src, dst, tuple(buckets), itemsize)


def flat_range(box: Box, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The flat element range ``box`` covers in a contiguous tensor of ``shape``, or None when
    it is not one range (it cuts a trailing dimension)."""
    row = 1
    for d in range(1, len(shape)):
        if box[d] != (0, shape[d]):
            return None
        row *= shape[d]
    return box[0][0] * row, box[0][1] * row


def _follows(prev: Transfer, t: Transfer, shapes: dict[tuple[int, str], tuple[int, ...]]
             ) -> bool:
    """Whether, on every receiver, ``t`` lands right after ``prev`` in the same parameter."""
    before = {p.rank: p for p in prev.placements}
    if len(before) != len(prev.placements) or len(t.placements) != len(before):
        return False
    for p in t.placements:
        q = before.get(p.rank)
        if q is None or q.param != p.param:
            return False
        a = flat_range(q.box, shapes[(q.rank, q.param)])
        b = flat_range(p.box, shapes[(p.rank, p.param)])
        if a is None or b is None or a[1] != b[0]:
            return False
    return True


def _shift(local: Box, unit: Box, chunk: Box) -> Box:
    """The part of ``local`` (the placement of ``unit``) that ``chunk`` (a sub-box of ``unit``
    along dim 0) maps to."""
    (l0, _), (u0, _), (c0, c1) = local[0], unit[0], chunk[0]
    return ((l0 + c0 - u0, l0 + c1 - u0),) + local[1:]
