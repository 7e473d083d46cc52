"""Checks for strings that end up in a job script, a Slurm directive or a path: one line of
printable text, and the names of experiments and trials.

Patterns are matched with ``re.fullmatch`` (``$`` would also match before a final newline).
Every error names the key and what is valid there; a section's error names only its own
field (the override machinery adds the dotted path of the section).
"""
from __future__ import annotations

import re
import unicodedata

from system.errors import ConfigError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
"""An experiment or trial name: a letter or digit, then letters, digits, ``_``, ``-``, ``.``."""
NAME_VALID = "a letter or digit, then letters, digits, '_', '-' or '.'"

_LINE_BREAKS = {"Cc", "Zl", "Zp"}
"""Unicode categories refused in one line: control characters (newline, carriage return, tab,
NUL, escape, DEL, C1 controls) and the line and paragraph separators."""


def control_char(value: str) -> str | None:
    """A description of the first control character (or line separator) in ``value``."""
    for i, c in enumerate(value):
        if unicodedata.category(c) in _LINE_BREAKS:
            return f"the control character {c!r} at position {i}"
    return None


def check_line(key: str, value: object) -> None:
    """``value`` is a ``str`` of one line of printable characters (empty is fine)."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r} must be a string, got {type(value).__name__}")
    bad = control_char(value)
    if bad is not None:
        raise ConfigError(f"{key}={value!r} contains {bad}; valid: one line of printable "
                          "characters (no newline, carriage return, tab or other control "
                          "character)")


def check_lines(key: str, values: object) -> None:
    """Every entry of a list of strings is one line (:func:`check_line`)."""
    if not isinstance(values, list):
        raise ConfigError(f"{key}={values!r} must be a list of strings")
    for i, v in enumerate(values):
        check_line(f"{key}[{i}]", v)


def check_name(key: str, value: str) -> None:
    """An experiment or trial name (:data:`NAME_RE`); empty means 'not set yet'."""
    if value and not (isinstance(value, str) and NAME_RE.fullmatch(value)):
        raise ConfigError(f"{key}={value!r} is not a valid name; valid: {NAME_VALID}")


def check_int(key: str, value: object, minimum: int) -> None:
    """An ``int`` (not a ``bool``) that is at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


MAX_WORKERS = 100_000
"""The most workers of one kind: more than any cluster runs (a count past it is a typo, and
planning a few million workers alone takes minutes and gigabytes)."""


def check_count(key: str, value: int) -> None:
    """A count of workers of one kind: 0 to :data:`MAX_WORKERS`."""
    if not 0 <= value <= MAX_WORKERS:
        raise ConfigError(f"{key}={value} is not valid; valid: 0 to {MAX_WORKERS} workers")
