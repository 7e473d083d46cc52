"""Prompts from local data: a ``.jsonl`` or ``.parquet`` file, or a directory a Hugging Face
``datasets`` object was saved to (``save_to_disk``). Columns map onto a prompt's fields through
``rl.task.fields`` (``prompt:question,answer:solution``); nothing is downloaded."""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

from system.errors import ConfigError

FIELDS = ("prompt", "answer", "id")
"""A prompt's fields; ``id`` is optional (default: the row's index)."""


def parse_fields(spec: str) -> dict[str, str]:
    """``"prompt:question,answer:solution"`` as ``{"prompt": "question", ...}``: the column
    each field is read from (unmapped fields read the column of their own name)."""
    out = {f: f for f in FIELDS}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        field, sep, column = (s.strip() for s in item.partition(":"))
        if not sep or field not in FIELDS or not column:
            raise ConfigError(f"fields={spec!r}: {item!r} is not FIELD:COLUMN with FIELD one "
                              f"of {list(FIELDS)}")
        out[field] = column
    return out


def check_path(key: str, path: str) -> None:
    """A prompt source must be a .jsonl or .parquet file or a directory (checked for existence
    when read: the launcher's machine need not see the workers' files)."""
    if path and not (path.endswith((".jsonl", ".parquet")) or not os.path.splitext(path)[1]
                     or os.path.isdir(path)):
        raise ConfigError(f"{key}={path!r} must be a .jsonl or .parquet file or a directory "
                          "saved by datasets' save_to_disk")


def _rows(path: str, split: str) -> Iterable[Mapping[str, Any]]:
    if os.path.isdir(path):
        return _saved_dataset(path, split)
    if not os.path.isfile(path):
        raise ConfigError(f"prompt file {path!r} does not exist")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _saved_dataset(path: str, split: str) -> Iterable[Mapping[str, Any]]:
    """A ``Dataset`` directory, or split ``split`` of a ``DatasetDict`` directory."""
    import datasets

    try:
        data = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise ConfigError(f"{path!r} is not a directory saved by datasets' save_to_disk: "
                          f"{e}") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ConfigError(f"{path!r} holds the splits {sorted(data)}, not {split!r} (set "
                              "rl.task.train_split / rl.task.eval_split)")
        data = data[split]
    return data


def load_prompts(path: str, fields: str = "", split: str = "train") -> list[dict[str, Any]]:
    """Prompts ``{"id", "prompt", "answer"}`` from ``path`` (``split``: the split of a saved
    ``DatasetDict``), columns mapped by ``fields``."""
    cols = parse_fields(fields)
    out = []
    for i, r in enumerate(_rows(path, split)):
        missing = [cols[f] for f in ("prompt", "answer") if cols[f] not in r]
        if missing:
            raise ConfigError(f"{path}: row {i} lacks the column(s) {missing} (columns: "
                              f"{sorted(r)}; map them with rl.task.fields=prompt:COL,answer:COL)")
        pid = r.get(cols["id"])
        out.append({"id": int(i if pid is None else pid), "prompt": str(r[cols["prompt"]]),
                    "answer": r[cols["answer"]]})
    ids = [p["id"] for p in out]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: prompt ids repeat (map a unique column with "
                          "rl.task.fields=id:COL, or drop the id column)")
    return out
