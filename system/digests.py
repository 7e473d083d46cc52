"""Content digests of a directory's files, shared out among several processes.

A checkpoint is written by many processes at once and can be far larger than one of them should
read alone: :func:`shares` splits its files among ``world`` ranks by size (largest first, each
to the least loaded rank; the same files give the same split everywhere), and each rank digests
(:func:`digest_share`) or checks (:func:`check_share`) its share only, so writing or restoring
reads the directory once more in all, spread over the ranks. The digest is CRC-32 (zlib's,
several GB/s): it catches corruption that keeps a file's size (a bad disk block, a torn
copy), not a forgery.
"""
from __future__ import annotations

import os
import zlib
from typing import Iterable, Mapping

ALGORITHM = "crc32"
CHUNK = 8 << 20


def file_digest(path: str) -> str:
    """``crc32:<8 hex digits>`` of the file at ``path``, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            crc = zlib.crc32(block, crc)
    return f"{ALGORITHM}:{crc:08x}"


def list_files(directory: str, skip: Iterable[str] = ()) -> dict[str, int]:
    """Every file under ``directory`` (relative path -> size), those in ``skip`` excepted."""
    skip = set(skip)
    out = {}
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, directory)
            if rel not in skip:
                out[rel] = os.path.getsize(path)
    return out


def shares(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """``sizes``' files split among ``world`` ranks, balanced by bytes: the largest first,
    each to the rank with the fewest bytes so far (ties: the lower rank, then the name)."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    loads = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = loads.index(min(loads))
        out[r].append(name)
        loads[r] += sizes[name]
    return out


def share(sizes: Mapping[str, int], rank: int, world: int) -> list[str]:
    """Rank ``rank``'s share of :func:`shares`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of the {world} ranks")
    return shares(sizes, world)[rank]


def digest_share(directory: str, rank: int, world: int,
                 skip: Iterable[str] = ()) -> dict[str, str]:
    """Digests of rank ``rank``'s share of the files under ``directory`` (all ranks must see
    the same files: call it once every writer is done)."""
    mine = share(list_files(directory, skip), rank, world)
    return {name: file_digest(os.path.join(directory, name)) for name in mine}


def check_share(directory: str, digests: Mapping[str, str], sizes: Mapping[str, int],
                rank: int, world: int) -> str | None:
    """Why rank ``rank``'s share of the files that ``digests`` lists differs from them (the
    first file that does), or None. Split by ``sizes``, the sizes written (every rank splits
    alike, whatever it sees on disk)."""
    for name in share({n: int(sizes.get(n, 0)) for n in digests}, rank, world):
        expected = digests[name]
        if not expected.startswith(ALGORITHM + ":"):
            return f"{name}: digest {expected!r} is not {ALGORITHM}"
        try:
            actual = file_digest(os.path.join(directory, name))
        except OSError as e:
            return f"{name}: {e}"
        if actual != expected:
            return f"{name}: content differs from what was written ({actual}, written {expected})"
    return None
