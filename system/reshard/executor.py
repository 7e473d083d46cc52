"""The resharding executor: runs one rank's part of a :class:`~system.reshard.plan.ReshardPlan`.

Process groups are built from one TCPStore (whose address the caller publishes in name
resolution, and which :mod:`system.rendezvous` hands over already under the group's secret key
prefix), one group per distinct broadcast member set and lane, each through its own
``PrefixStore`` below that prefix, so trainer ranks and vLLM workers (which each have their own
default group) can share them. Buckets run in the plan's global order with a window of asynchronous broadcasts in
flight: packing the next bucket overlaps the current transfer, and since every rank issues its
operations in the same global order no collective can wait on another. On gloo, consecutive
broadcasts among the same ranks alternate between two lanes (their own TCP connections), so one's
rendezvous overlaps the other's bytes. Nothing is copied where it need not be: a lone region is
sent from the sender's shard itself, and a receiver takes a run straight into its parameter;
only packed leftovers are copied out of a staging buffer.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import time
from typing import Any, Mapping

import torch
import torch.distributed as dist

from system.reshard.params import Box, box_shape
from system.reshard.plan import Bucket, ReshardPlan, flat_range

log = logging.getLogger(__name__)


def _slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _check_shapes(src: Mapping[str, torch.Tensor], boxes: Mapping[str, Box]) -> None:
    for name, box in boxes.items():
        if name in src and tuple(src[name].shape) != box_shape(box):
            raise ValueError(f"source {name} has shape {tuple(src[name].shape)}, its box "
                             f"{list(box)} has {box_shape(box)}")


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
        self._groups: dict[tuple[tuple[int, ...], int], Any] = {}

    def get(self, members: tuple[int, ...], lane: int = 0) -> Any:
        """The group of ``members``; ``lane`` > 0 gives further groups of the same members (their
        own connections), so that several broadcasts among them can be on the wire at once."""
        if (members, lane) not in self._groups:
            key = f"{self.prefix}/{'-'.join(map(str, members))}" + (f"/lane{lane}" if lane else "")
            sub = dist.PrefixStore(key, self.store)
            idx, size = members.index(self.rank), len(members)
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                pg = dist.ProcessGroupNCCL(sub, idx, size, opts)
            else:
                pg = dist.ProcessGroupGloo(sub, idx, size, self.timeout)
            self._groups[(members, lane)] = pg
        return self._groups[(members, lane)]


@dataclasses.dataclass
class ReshardStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    buckets: int = 0
    peak_buffer_bytes: int = 0
    bytes_packed: int = 0    # copied into staging buffers before sending
    bytes_unpacked: int = 0  # received into staging buffers, then copied into place


class ReshardExecutor:
    """One rank's side of a plan. Construct on every rank of the plan (it creates this rank's
    groups, collectively, in the plan's sorted order), then call :meth:`run` once per update."""

    def __init__(self, plan: ReshardPlan, rank: int, groups: GroupFactory,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 inflight: int = 4, lanes: int | None = None) -> None:
        if torch.empty(0, dtype=dtype).element_size() != plan.itemsize:
            raise ValueError(f"dtype {dtype} does not match the plan's itemsize {plan.itemsize}")
        self.plan = plan
        self.rank = rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.inflight = max(1, inflight)
        # gloo: consecutive broadcasts among the same ranks alternate between two lanes (two
        # sets of TCP connections), so one's rendezvous and copies overlap the other's transfer;
        # NCCL runs one communicator's operations in order on its stream: one lane
        self.lanes = lanes if lanes is not None else (2 if groups.backend == "gloo" else 1)
        if self.lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {self.lanes}")
        count: collections.Counter[tuple[int, ...]] = collections.Counter()
        self.buckets: list[tuple[Bucket, int]] = []
        for b in plan.buckets:  # the lane of a bucket: its index among its members' buckets
            lane = count[b.members] % self.lanes
            count[b.members] += 1
            if rank in b.members:
                self.buckets.append((b, lane))
        # created in one global sorted order on every rank: no two ranks wait on each other
        self._groups = {(m, lane): groups.get(m, lane) for m in plan.groups if rank in m
                        for lane in range(min(self.lanes, count[m]))}
        self.backend = groups.backend
        # NCCL: the transfers run on a stream of their own, so a broadcast that never
        # completes (a peer died) holds up only that stream, not the default one training uses
        self._stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda" else None)

    def abort(self) -> None:
        """Give up this executor's groups (a peer died): NCCL's communicators are aborted, which
        ends a broadcast stuck on the dead peer (the ``run`` waiting for it returns or raises;
        its result is worthless) instead of leaving it on the GPU until the group's timeout,
        when NCCL's watchdog would end the whole process. Gloo needs nothing: its broadcasts
        fail when the peer's connection closes."""
        if self.backend != "nccl":
            return
        for pg in self._groups.values():
            try:
                pg.abort()
            except Exception as e:  # best effort: the executor is dropped either way
                log.warning("aborting a weight-update group failed: %s", e)

    def run(self, src: Mapping[str, torch.Tensor] | None = None,
            src_boxes: Mapping[str, Box] | None = None,
            dst: Mapping[str, torch.Tensor] | None = None) -> ReshardStats:
        """Send this rank's regions from ``src`` (its local tensors by the names of the plan's
        source layout: HF-named shards, or megatron's own tensors; each transfer says where in
        them it lies) and/or receive into ``dst`` (its local parameters, by name, written in
        place). ``src_boxes`` (HF-named shards only, optional): the boxes of the full tensors
        the caller believes ``src`` holds; a shape that disagrees is refused."""
        if src is not None and src_boxes is not None:
            _check_shapes(src, src_boxes)
        if self._stream is None:
            return self._run(src, dst)
        # the side stream first waits for what the default stream wrote (the weights); the
        # host waits for the side stream at the end, so the caller's later work sees the result
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            return self._run(src, dst)

    def _run(self, src: Mapping[str, torch.Tensor] | None,
             dst: Mapping[str, torch.Tensor] | None) -> ReshardStats:
        stats = ReshardStats()
        t0 = time.perf_counter()
        pending: collections.deque[tuple[Bucket, torch.Tensor | None, Any, int]] = \
            collections.deque()
        live = 0
        for bucket, lane in self.buckets:
            buf, staged = self._buffer(bucket, src, dst)
            if bucket.sender == self.rank:
                if staged:
                    self._pack(bucket, buf, src)
                    stats.bytes_packed += buf.numel() * buf.element_size()
                stats.bytes_sent += buf.numel() * buf.element_size()
            opts = dist.BroadcastOptions()
            opts.rootRank = bucket.members.index(bucket.sender)
            work = self._groups[(bucket.members, lane)].broadcast([buf], opts)
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
        if self._stream is not None:
            self._stream.synchronize()
        stats.seconds = time.perf_counter() - t0
        stats.buckets = len(self.buckets)
        return stats

    def _buffer(self, bucket: Bucket, src: Mapping[str, torch.Tensor] | None,
                dst: Mapping[str, torch.Tensor] | None) -> tuple[torch.Tensor, bool]:
        """The tensor to broadcast, without copies where it can be: the sender's shard itself
        for a lone contiguous region; on a receiver, the range of its own parameter that a run
        of regions fills back to back. Else a new flat buffer (packed or unpacked)."""
        view = None
        if bucket.sender == self.rank:
            if len(bucket.transfers) == 1 and src is not None:
                t = bucket.transfers[0]
                view = src[t.source.param][_slices(t.source.box)]
        elif dst is not None:
            view = self._run_view(bucket, dst)
        if view is not None and view.is_contiguous() and view.dtype == self.dtype:
            return view.view(-1), False
        return torch.empty(bucket.numel, dtype=self.dtype, device=self.device), True

    def _run_view(self, bucket: Bucket, dst: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """This receiver's part of ``bucket`` as one slice of one of its parameters, if the
        bucket's regions land there back to back."""
        name, start, end = None, None, None
        for t in bucket.transfers:
            mine = [p for p in t.placements if p.rank == self.rank]
            if len(mine) != 1 or (name is not None and mine[0].param != name):
                return None
            name = mine[0].param
            target = dst[name]
            if not target.is_contiguous():
                return None
            rng = flat_range(mine[0].box, tuple(target.shape))
            if rng is None or (end is not None and rng[0] != end):
                return None
            start = rng[0] if start is None else start
            end = rng[1]
        if name is None or start is None or end is None:
            return None
        return dst[name].view(-1)[start:end]

    def _pack(self, bucket: Bucket, buf: torch.Tensor, src: Mapping[str, torch.Tensor] | None
              ) -> None:
        if src is None:
            raise ValueError(f"rank {self.rank} sends but was given no source tensors")
        off = 0
        for t in bucket.transfers:
            n = t.numel
            region = src[t.source.param][_slices(t.source.box)]
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
            stats.bytes_unpacked += buf.numel() * buf.element_size()
        return extra
