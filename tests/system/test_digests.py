"""Content digests shared out among ranks (``system.digests``)."""
from __future__ import annotations

import os
import zlib

import pytest

from system.digests import check_share, digest_share, file_digest, list_files, share, shares


def _files(root, sizes: dict[str, int]) -> None:
    for name, size in sizes.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(bytes(i % 251 for i in range(size)))


def test_a_file_digest_is_the_crc32_of_its_bytes_read_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr("system.digests.CHUNK", 7)  # several chunks
    data = os.urandom(100)
    (tmp_path / "f").write_bytes(data)
    assert file_digest(str(tmp_path / "f")) == f"crc32:{zlib.crc32(data):08x}"


def test_shares_cover_every_file_once_balanced_by_bytes_the_same_everywhere():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    split = shares(sizes, 2)
    assert split == [["a", "d", "e"], ["b", "c"]]  # 110 bytes each (a tie: the lower rank)
    assert shares(dict(reversed(sizes.items())), 2) == split  # listing order does not matter
    assert sorted(sum(shares(sizes, 3), [])) == sorted(sizes)
    assert shares(sizes, 1) == [["a", "b", "c", "d", "e"]]
    assert shares(sizes, 8)[7] == []  # more ranks than files: some digest nothing
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 ranks"):
        share(sizes, 2, 2)


def test_the_ranks_digest_their_shares_and_each_checks_its_own(tmp_path):
    root = str(tmp_path)
    _files(root, {"actor/model.safetensors": 4000, "actor/optimizer.rank0.pt": 3000,
                  "actor/optimizer.rank1.pt": 3000, "state.msgpack": 10, "meta.json": 5})
    parts = [digest_share(root, r, 2, skip=("meta.json",)) for r in range(2)]
    assert not set(parts[0]) & set(parts[1])
    digests = {**parts[0], **parts[1]}
    assert set(digests) == set(list_files(root)) - {"meta.json"}
    sizes = list_files(root)
    assert [check_share(root, digests, sizes, r, 2) for r in range(2)] == [None, None]
    # the same size, other bytes: only the rank whose share holds the file finds it
    path = os.path.join(root, "actor", "optimizer.rank1.pt")
    with open(path, "r+b") as f:
        f.seek(1234)
        f.write(b"\xff")
    found = [check_share(root, digests, sizes, r, 2) for r in range(2)]
    owner = 0 if "actor/optimizer.rank1.pt" in parts[0] else 1
    assert found[1 - owner] is None
    assert found[owner].startswith("actor/optimizer.rank1.pt: content differs from what was "
                                   "written (crc32:")
    assert check_share(root, digests, sizes, 0, 1) == found[owner]  # one rank checks them all
    os.unlink(path)
    assert "No such file" in check_share(root, digests, sizes, owner, 2)
    assert "is not crc32" in check_share(root, {"state.msgpack": "md5:00"}, sizes, 0, 1)
