"""Read back what a W&B run wrote offline: its ``run-*.wandb`` file is a LevelDB-style log
(a 7-byte ``:W&B`` header, then 32 KiB blocks of CRC-framed chunks) of protobuf ``Record``s."""
from __future__ import annotations

import json
import struct
import time
from typing import Any

_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # crc32c, length, type (1 full, 2 first, 3 middle, 4 last)


def records(path: str) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    out, pos, parts = [], 7, b""
    while pos + _HEADER.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER.size:  # the block's tail is padding
            pos += room
            continue
        _, length, kind = _HEADER.unpack_from(data, pos)
        if pos + _HEADER.size + length > len(data):  # still being written
            break
        chunk = data[pos + _HEADER.size:pos + _HEADER.size + length]
        pos += _HEADER.size + length
        if kind == 0 and length == 0:
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
    return out


def wait_closed(path: str, timeout: float = 30.0) -> None:
    """Wait for the run's ``exit`` record: ``run.finish()`` can return before W&B's service
    process has written the file's last records."""
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in records(path)):
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.1)


def history(path: str) -> list[dict[str, Any]]:
    """The rows ``run.log`` wrote, as ``{key: value}``."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                         for i in rec.history.item})
    return rows


def run_info(path: str) -> dict[str, str]:
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return {"name": rec.run.display_name, "project": rec.run.project,
                    "group": rec.run.run_group}
    return {}
