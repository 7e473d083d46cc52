"""The resharding executor: runs one rank's part of a :class:`~system.reshard_plan.ReshardPlan`.

Process groups are built from one TCPStore (whose address the caller publishes in name
resolution), one group per distinct broadcast member set, each through its own ``PrefixStore``,
so trainer ranks and vLLM workers (which each have their own default group) can share them.
Buckets run in the plan's global order with a small window of asynchronous broadcasts in
flight: packing the next bucket overlaps the current transfer, and since every rank issues its
operations in the same global order no collective can wait on another. Receivers copy each
region straight from the bucket into their own parameter storage.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from system.param_specs import Box, ParamSpec, stage_of, tp_box
from system.reshard_plan import Bucket, ReshardPlan
from system.topology import TrainLayout


def _slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def train_shard_boxes(specs: list[ParamSpec], layout: TrainLayout, rank: int, num_layers: int
                      ) -> dict[str, Box]:
    """The box of every full parameter that training ``rank`` holds (its pp stage, tp shard)."""
    c = layout.coord(rank)
    return {s.name: tp_box(s, layout.tp, c.tp) for s in specs
            if stage_of(s, num_layers, layout.pp) == c.pp}


class GroupFactory:
    """Process groups over explicit sorted member lists of a global rank space. Give each rank
    its own store client: a client blocked in ``wait`` holds its connection, so ranks (threads)
    sharing one can starve each other's rendezvous."""

    def __init__(self, store: Any, rank: int, backend: str = "gloo",
                 timeout: float = 300.0, prefix: str = "reshard") -> None:
        self.store = store
        self.rank = rank
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout)
        self.prefix = prefix
        self._groups: dict[tuple[int, ...], Any] = {}

    def get(self, members: tuple[int, ...]) -> Any:
        if members not in self._groups:
            sub = dist.PrefixStore(f"{self.prefix}/{'-'.join(map(str, members))}", self.store)
            idx, size = members.index(self.rank), len(members)
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                pg = dist.ProcessGroupNCCL(sub, idx, size, opts)
            else:
                pg = dist.ProcessGroupGloo(sub, idx, size, self.timeout)
            self._groups[members] = pg
        return self._groups[members]


@dataclasses.dataclass
class ReshardStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    peak_buffer_bytes: int = 0


class ReshardExecutor:
    """One rank's side of a plan. Construct on every rank of the plan (it creates this rank's
    groups, collectively, in the plan's sorted order), then call :meth:`run` once per update."""

    def __init__(self, plan: ReshardPlan, rank: int, groups: GroupFactory,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 inflight: int = 2) -> None:
        if torch.empty(0, dtype=dtype).element_size() != plan.itemsize:
            raise ValueError(f"dtype {dtype} does not match the plan's itemsize {plan.itemsize}")
        self.plan = plan
        self.rank = rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.inflight = max(1, inflight)
        self.buckets = plan.for_rank(rank)
        self._groups = {m: groups.get(m) for m in plan.groups if rank in m}

    def run(self, src: Mapping[str, torch.Tensor] | None = None,
            src_boxes: Mapping[str, Box] | None = None,
            dst: Mapping[str, torch.Tensor] | None = None) -> ReshardStats:
        """Send this rank's regions from ``src`` (its local shards, HF names, covering
        ``src_boxes`` of the full tensors) and/or receive into ``dst`` (its local parameters,
        by name, written in place)."""
        stats = ReshardStats()
        t0 = time.perf_counter()
        pending: collections.deque[tuple[Bucket, torch.Tensor | None, Any, int]] = \
            collections.deque()
        live = 0
        for bucket in self.buckets:
            buf, staged = self._buffer(bucket, src, src_boxes, dst)
            if bucket.sender == self.rank:
                if staged:
                    self._pack(bucket, buf, src, src_boxes)
                stats.bytes_sent += buf.numel() * buf.element_size()
            opts = dist.BroadcastOptions()
            opts.rootRank = bucket.members.index(bucket.sender)
            work = self._groups[bucket.members].broadcast([buf], opts)
            extra = buf.numel() * buf.element_size() if staged else 0
            pending.append((bucket, buf if staged else None, work, extra))
            live += extra
            stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, live)
            if not staged and bucket.sender != self.rank:
                stats.bytes_received += buf.numel() * buf.element_size()
            while len(pending) > self.inflight:
                live -= self._finish(*pending.popleft(), dst, stats)
        while pending:
            live -= self._finish(*pending.popleft(), dst, stats)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        stats.buckets = len(self.buckets)
        return stats

    def _buffer(self, bucket: Bucket, src: Mapping[str, torch.Tensor] | None,
                src_boxes: Mapping[str, Box] | None, dst: Mapping[str, torch.Tensor] | None
                ) -> tuple[torch.Tensor, bool]:
        """The tensor to broadcast: for a lone region, the sender's shard or the receiver's
        parameter itself when that view is contiguous (no copies); else a new flat buffer."""
        if len(bucket.transfers) == 1:
            t = bucket.transfers[0]
            view = None
            if bucket.sender == self.rank and src is not None and src_boxes is not None:
                view = src[t.param][_slices(t.box, src_boxes[t.param])]
            elif dst is not None:
                mine = [p for p in t.placements if p.rank == self.rank]
                if len(mine) == 1:
                    view = dst[mine[0].param][_slices(mine[0].box)]
            if view is not None and view.is_contiguous() and view.dtype == self.dtype:
                return view.view(-1), False
        return torch.empty(bucket.numel, dtype=self.dtype, device=self.device), True

    def _pack(self, bucket: Bucket, buf: torch.Tensor, src: Mapping[str, torch.Tensor] | None,
              src_boxes: Mapping[str, Box] | None) -> None:
        if src is None or src_boxes is None:
            raise ValueError(f"rank {self.rank} sends but was given no source tensors")
        off = 0
        for t in bucket.transfers:
            n = t.numel
            region = src[t.param][_slices(t.box, src_boxes[t.param])]
            buf[off:off + n].view(region.shape).copy_(region)
            off += n

    def _finish(self, bucket: Bucket, buf: torch.Tensor | None, work: Any, extra: int,
                dst: Mapping[str, torch.Tensor] | None, stats: ReshardStats) -> int:
        """Wait for a broadcast; a receiver unpacks a staged bucket. Returns the staging bytes
        released."""
        work.wait()
        if buf is not None and bucket.sender != self.rank:
            if dst is None:
                raise ValueError(f"rank {self.rank} receives but was given no destination")
            off = 0
            for t in bucket.transfers:
                n = t.numel
                for p in t.placements:
                    if p.rank == self.rank:
                        target = dst[p.param][_slices(p.box)]
                        target.copy_(buf[off:off + n].view(target.shape))
                off += n
            stats.bytes_received += buf.numel() * buf.element_size()
        return extra
