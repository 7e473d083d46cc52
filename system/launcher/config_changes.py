"""What a continued trial runs with that its last launch did not: the settings that differ
between the trial's ``config.yaml`` (the last launch's resolved config) and this launch's.

A trial continues with the settings of the command that continues it, not its first one, so a
relaunch that forgets an override (``rl.keep_checkpoints=0``, say: the next commit prunes the
older checkpoints) or adds one changes the run without a word. The launcher prints these lines
when it continues a trial (and a dry run shows them).
"""
from __future__ import annotations

from typing import Any

import yaml

SHOWN = 12
"""Changed settings named one by one; more are counted."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def changed_settings(before_yaml: str, now_yaml: str) -> list[str]:
    """``key: before -> now`` for every setting that differs (a key only one side has: that
    side's value and ``(none)``), sorted by key. Empty when ``before_yaml`` does not parse as a
    mapping: nothing to compare with."""
    try:
        before = yaml.safe_load(before_yaml)
    except yaml.YAMLError:
        return []
    if not isinstance(before, dict):
        return []
    old, new = flatten(before), flatten(yaml.safe_load(now_yaml))
    return [f"{key}: {_show(old, key)} -> {_show(new, key)}"
            for key in sorted(old.keys() | new.keys())
            if old.get(key, _NONE) != new.get(key, _NONE)]


_NONE = object()


def _show(settings: dict[str, Any], key: str) -> str:
    if key not in settings:
        return "(none)"
    value = settings[key]
    if isinstance(value, str) and value and value == value.strip() and "\n" not in value:
        text = value  # as typed: YAML would quote OFF (an enum's name) or 1.0 as not strings
    else:
        text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def describe(trial: str, changes: list[str]) -> str:
    """The lines the launcher prints (empty for no change)."""
    if not changes:
        return ""
    shown = changes[:SHOWN] + ([f"... and {len(changes) - SHOWN} more (see config.yaml)"]
                               if len(changes) > SHOWN else [])
    return (f"{trial} continues with {len(changes)} setting(s) changed since its last launch:\n"
            + "\n".join(f"  {line}" for line in shown))
