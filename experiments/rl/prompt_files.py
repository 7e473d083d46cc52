"""Prompts from local data: a ``.jsonl`` or ``.parquet`` file, or a directory a Hugging Face
``datasets`` object was saved to (``save_to_disk``). Columns map onto a prompt's fields through
``rl.task.fields`` (``prompt:question,answer:solution``); nothing is downloaded."""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Iterator, Mapping

from system.errors import ConfigError, first_line

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


SUFFIXES = (".jsonl", ".parquet")


def check_path(key: str, path: str) -> None:
    """A prompt source must be a .jsonl or .parquet file or a directory (checked for existence
    when read: the launcher's machine need not see the workers' files)."""
    if path and not (path.endswith(SUFFIXES) or not os.path.splitext(path)[1]
                     or os.path.isdir(path)):
        raise ConfigError(f"{key}={path!r} must be a .jsonl or .parquet file or a directory "
                          "saved by datasets' save_to_disk")


EXAMPLE = '{"prompt": "1+1=", "answer": 2}'
"""A valid line of a .jsonl prompt file, for the error messages."""

_READ_ERRORS = (ValueError, TypeError, KeyError, IndexError, FileNotFoundError,
                IsADirectoryError, NotADirectoryError, PermissionError)
"""What reading a malformed (or unreadable) parquet file or saved dataset raises (pyarrow's
ArrowInvalid is a ValueError). Other OSErrors (EIO, a stale NFS handle) may pass: they stay
errors that a recovery retries."""


def _source(key: str, path: str) -> str:
    """How messages name the prompt source: ``rl.task.train_path='/d/train.jsonl'``."""
    return f"{key}={path!r}" if key else f"prompt file {path!r}"


def _rows(src: str, path: str, split: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each row of ``path``: ``where`` is ``line N`` (1-based, of a
    .jsonl file) or ``row N`` (0-based, of a parquet file or saved dataset)."""
    if os.path.isdir(path):
        yield from ((f"row {i}", r) for i, r in enumerate(_saved_dataset(src, path, split)))
        return
    if not os.path.isfile(path):
        raise ConfigError(f"{src} does not exist; valid: a .jsonl or .parquet file or a "
                          "directory saved by datasets' save_to_disk")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except _READ_ERRORS as e:
            raise ConfigError(f"{src} is not a readable parquet file ({_first_line(e)}); "
                              "valid: a parquet file with a prompt and an answer column") from None
        yield from ((f"row {i}", r) for i, r in enumerate(rows))
        return
    if not path.endswith(".jsonl"):
        raise ConfigError(f"{src} is a file, not a .jsonl or .parquet file; valid: a .jsonl or "
                          ".parquet file or a directory saved by datasets' save_to_disk")
    yield from _jsonl(src, path)


def _jsonl(src: str, path: str) -> Iterator[tuple[str, Any]]:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (PermissionError, IsADirectoryError) as e:
        raise ConfigError(f"{src} cannot be read ({e.strerror}); valid: a file the workers "
                          "can read") from None
    for n, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{src}: line {n} is not UTF-8 text (byte {e.start + 1} of the "
                              f"line is {raw[e.start:e.start + 1]!r}); valid: a UTF-8 .jsonl "
                              "file") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{src}: line {n} is not JSON ({e.msg} at column {e.colno}); "
                              f"valid: one JSON object per line, like {EXAMPLE}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{src}: line {n} is {_short(row)} ({type(row).__name__}), not a "
                              f"JSON object; valid: one JSON object per line, like {EXAMPLE}")
        yield f"line {n}", row


def _first_line(e: BaseException) -> str:
    return (first_line(e) or type(e).__name__)[:200]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _saved_dataset(src: str, path: str, split: str) -> Iterable[Mapping[str, Any]]:
    """A ``Dataset`` directory, or split ``split`` of a ``DatasetDict`` directory."""
    import datasets

    if _no_shards(path) or _no_shards(os.path.join(path, split)):
        return []  # (datasets' load_from_disk fails on a saved dataset without rows)
    try:
        data = datasets.load_from_disk(path)
    except _READ_ERRORS as e:
        raise ConfigError(f"{src} is not a readable directory saved by datasets' save_to_disk "
                          f"({_first_line(e)}); valid: a .jsonl or .parquet file or such a "
                          "directory") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ConfigError(f"{src} holds the splits {sorted(data)}, not {split!r} (set "
                              "rl.task.train_split / rl.task.eval_split)")
        data = data[split]
    return data


def _no_shards(path: str) -> bool:
    """``path`` is a saved ``Dataset`` without rows (no data files)."""
    try:
        with open(os.path.join(path, "state.json")) as f:
            return json.load(f).get("_data_files") == []
    except (OSError, ValueError, AttributeError):
        return False


INT64 = (-(1 << 63), (1 << 63) - 1)
"""The integers a prompt's id may be: what the wire (msgpack) carries as one (a task names
its prompt by id; the answer stays with the rollout worker that scores it)."""


def _prompt_id(value: Any) -> int | None:
    """An id column's value as an int (``7``, ``7.0``, ``"7"``) of 64 bits, or None if it is
    not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        pid = value
    elif isinstance(value, float) and value.is_integer():
        pid = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,20}\s*", value):
        pid = int(value)
    else:
        return None
    return pid if INT64[0] <= pid <= INT64[1] else None


def load_prompts(path: str, fields: str = "", split: str = "train",
                 key: str = "") -> list[dict[str, Any]]:
    """Prompts ``{"id", "prompt", "answer"}`` from ``path`` (``split``: the split of a saved
    ``DatasetDict``), columns mapped by ``fields``. Every problem with the source is one
    :class:`ConfigError` naming ``key`` (``rl.task.train_path``), the file and the line or row."""
    src = _source(key, path)
    cols = parse_fields(fields)
    out = []
    where_of: dict[int, str] = {}
    for i, (where, r) in enumerate(_rows(src, path, split)):
        missing = [cols[f] for f in ("prompt", "answer") if cols[f] not in r]
        if missing:
            raise ConfigError(f"{src}: {where} lacks the column(s) {missing} (columns: "
                              f"{sorted(r)}; map them with rl.task.fields=prompt:COL,answer:COL)")
        prompt, answer = r[cols["prompt"]], r[cols["answer"]]
        if not isinstance(prompt, str):
            raise ConfigError(f"{src}: {where}: the prompt (column {cols['prompt']!r}) is "
                              f"{_short(prompt)} ({type(prompt).__name__}); valid: a string")
        if answer is None:
            raise ConfigError(f"{src}: {where}: the answer (column {cols['answer']!r}) is null; "
                              "valid: a number or a string")
        raw = r.get(cols["id"])
        pid = i if raw is None else _prompt_id(raw)
        if pid is None:
            raise ConfigError(f"{src}: {where}: id {_short(raw)} (column {cols['id']!r}) is not "
                              "a 64-bit integer; valid: integer ids from -2**63 to 2**63-1 (or "
                              "map another column with "
                              "rl.task.fields=id:COL, or drop the column to number the rows "
                              "from 0)")
        if pid in where_of:
            raise ConfigError(f"{src}: {where}: id {pid} repeats that of {where_of[pid]}; valid: "
                              "unique ids (map a unique column with rl.task.fields=id:COL, or "
                              "drop the id column)")
        where_of[pid] = where
        out.append({"id": pid, "prompt": prompt, "answer": answer})
    return out
