"""What the checkpoint digests cost, beside what writing the checkpoint costs, in one run.

    .venv/bin/python tests/benchmarks/checkpoint_digest.py              # 512 MiB, 1 and 2 ranks
    .venv/bin/python tests/benchmarks/checkpoint_digest.py --mib 2048 --ranks 1,2,4

A synthetic checkpoint like a model worker's (one model file of half the bytes, one optimizer
file per rank for the rest, a few small files) is written and fsynced, as
``ModelWorker.save`` does; then ``world`` processes each digest their share
(:func:`system.digests.digest_share`, what every save adds) and check it
(:func:`system.digests.check_share`, what every restore adds). The page cache holds the files
as it does right after a save; a restore on another node reads them from the file system.

Prints ``name: value`` lines:
- write_s: writing and fsyncing the checkpoint (one process)
- digest_s_ranks<N>, check_s_ranks<N>: the slowest rank's digest / check time with N ranks
- digest_over_write_ranks<N>: digest_s / write_s (what the digests add to a checkpoint's time)
- digest_gib_s_ranks<N>: checkpoint bytes over digest_s
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time

from system.digests import check_share, digest_share, list_files
from system.files import fsync_path


def write_checkpoint(root: str, mib: int, ranks: int) -> float:
    """Write and fsync the synthetic checkpoint; its seconds."""
    t0 = time.perf_counter()
    actor = os.path.join(root, "actor")
    os.makedirs(actor)
    block = os.urandom(1 << 20)
    files = {"actor/model.safetensors": mib // 2}
    files.update({f"actor/optimizer.rank{r}.pt": (mib - mib // 2) // ranks for r in range(ranks)})
    for name, size in files.items():
        with open(os.path.join(root, name), "wb") as f:
            for _ in range(size):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    for name in ("actor/config.json", "actor/tokenizer.json", "master_state.msgpack"):
        with open(os.path.join(root, name), "wb") as f:
            f.write(os.urandom(4096))
        fsync_path(os.path.join(root, name))
    fsync_path(actor)
    return time.perf_counter() - t0


def _digest(args: tuple[str, int, int]) -> tuple[dict[str, str], float]:
    root, rank, world = args
    t0 = time.perf_counter()
    out = digest_share(root, rank, world)
    return out, time.perf_counter() - t0


def _check(args: tuple[str, dict[str, str], dict[str, int], int, int]) -> tuple[str | None,
                                                                                 float]:
    root, digests, sizes, rank, world = args
    t0 = time.perf_counter()
    problem = check_share(root, digests, sizes, rank, world)
    return problem, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="checkpoint size (MiB)")
    ap.add_argument("--ranks", default="1,2", help="comma-separated rank counts to measure")
    a = ap.parse_args()
    worlds = [int(x) for x in a.ranks.split(",")]
    root = tempfile.mkdtemp(prefix="ckpt-digest-")
    try:
        write_s = write_checkpoint(root, a.mib, max(worlds))
        print(f"checkpoint_mib: {a.mib}")
        print(f"write_s: {write_s:.3f}")
        sizes = list_files(root)
        ctx = mp.get_context("spawn")
        for world in worlds:
            with ctx.Pool(world) as pool:
                pool.map(_digest, [(root, 0, 1)] * world)  # (warm: imports, page cache)
                t0 = time.perf_counter()
                parts = pool.map(_digest, [(root, r, world) for r in range(world)])
                digest_s = time.perf_counter() - t0
                digests = {k: v for part, _ in parts for k, v in part.items()}
                assert set(digests) == set(sizes), "a file no rank digested"
                t0 = time.perf_counter()
                checks = pool.map(_check, [(root, digests, sizes, r, world)
                                           for r in range(world)])
                check_s = time.perf_counter() - t0
            assert all(p is None for p, _ in checks), checks
            print(f"digest_s_ranks{world}: {digest_s:.3f}")
            print(f"check_s_ranks{world}: {check_s:.3f}")
            print(f"digest_over_write_ranks{world}: {digest_s / write_s:.3f}")
            print(f"digest_gib_s_ranks{world}: {a.mib / 1024 / digest_s:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
