"""What the benchmarks' spawned ranks share: start them and collect one result each, a barrier
that waits on the host, the device of a rank, and a box as slices."""
from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

import torch


def sl(box: Any) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def host_barrier(group, backend: str, dev) -> None:
    """Every rank of ``group`` arrives; NCCL's wait() only orders streams: the host waits for
    the allreduce."""
    if backend == "gloo":
        group.barrier().wait()
    else:
        group.allreduce([torch.zeros(1, device=dev)]).wait()
        torch.cuda.synchronize(dev)


def rank_device(rank: int, backend: str) -> torch.device:
    """The device of ``rank``: a GPU (round robin) over NCCL, made the current device (NCCL's own
    allocations and barriers go to it), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    dev = torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    torch.cuda.set_device(dev)
    return dev


def spawn(fn: Callable, world: int, args: tuple) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, *args, out)) for r in range(world)]
    for pr in procs:
        pr.start()
    results = []
    while len(results) < world:
        try:
            results.append(out.get(timeout=5))
        except Exception:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a benchmark rank failed (exit codes {dead})")
    for pr in procs:
        pr.join()
    return sorted(results, key=lambda r: r["rank"])
