"""Command-line parsing: ``exp=NAME trial=T [dotted.key=value ...] [--dry-run] [--help]``.

Overrides are type-checked by OmegaConf against the experiment's structured config. Every mistake
becomes one :class:`~system.errors.ConfigError` naming the key and the valid choices there. A key
is given once (the same value again is no conflict), and every float is finite.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode

from system.launcher.config import ExperimentConfig
from system.errors import ConfigError, first_line
from system.structs import field_docs


@dataclasses.dataclass
class CliArgs:
    exp: str = ""
    trial: str = ""
    overrides: list[str] = dataclasses.field(default_factory=list)
    dry_run: bool = False
    help: bool = False
    flags: dict[str, bool] = dataclasses.field(default_factory=dict)


FLAGS = {"--dry-run": "dry_run", "--help": "help", "-h": "help"}

FLOAT_LIMIT = 1e9
"""The largest magnitude of any float key: as seconds (most of them) about 31 years, and past
it the waits overflow (a heartbeat TTL of 1e300 killed every process's keep-alive thread with
OverflowError); no other float key (rates, coefficients, sizes) has a use for more."""


LAUNCH_USAGE = "usage: python -m system.launch exp=NAME trial=T [key=value ...]"


def parse_cli(argv: Sequence[str], extra_flags: Sequence[str] = (),
              usage: str = LAUNCH_USAGE) -> CliArgs:
    """The command line's flags, ``exp``, ``trial`` and overrides; ``usage`` ends the message
    when ``exp`` or ``trial`` is missing."""
    args = CliArgs()
    given: dict[str, str] = {}
    for item in argv:
        if item.startswith("-"):
            if item in FLAGS:
                setattr(args, FLAGS[item], True)
            elif item in extra_flags:
                args.flags[item] = True
            else:
                raise ConfigError(f"unknown flag {item!r}; valid: {sorted([*FLAGS, *extra_flags])}")
            continue
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"argument {item!r} is not key=value")
        if key in ("exp", "trial"):
            _once(given, key, item)
        if key == "exp":
            args.exp = value
        elif key == "trial":
            args.trial = value
        else:
            args.overrides.append(item)
    if not args.help:
        missing = [k for k in ("exp", "trial") if not getattr(args, k)]
        if missing:
            raise ConfigError(f"missing {' and '.join(k + '=...' for k in missing)} ({usage})")
    return args


def _once(given: dict[str, str], key: str, item: str) -> None:
    """Record ``item`` (``key=value``, or a section's shorthand for ``key``) as setting ``key``;
    one setting it to another value before is refused (the last would win, silently)."""
    first = given.setdefault(key, item)
    if first.partition("=")[2] != item.partition("=")[2]:
        raise ConfigError(f"{key} given twice: {first} and {item}; give each key once")


def _describe(node: DictConfig) -> str:
    return ", ".join(str(k) for k in node.keys())


def apply_overrides(base: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """``base`` with ``overrides`` applied, validated by every section's ``__post_init__``."""
    conf = OmegaConf.structured(base)
    given: dict[str, str] = {}  # key (a section's shorthand resolved) -> the override setting it
    for item in overrides:
        key, _, raw = item.partition("=")
        parts = key.split(".")
        node: Any = conf
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the top level"
            if not isinstance(node, DictConfig):
                raise ConfigError(f"unknown key {key!r}: {where!r} is a value, not a section")
            if part not in node:
                retired = getattr(OmegaConf.get_type(node), "RETIRED_KEYS", {})
                if part in retired:  # a section says why a key it dropped is gone
                    raise ConfigError(f"{key} is not accepted: {retired[part]}")
                raise ConfigError(f"unknown key {key!r}: no {part!r} at {where}; "
                                  f"valid keys there: {_describe(node)}")
            node = node._get_node(part)
        value: Any = None if raw.lower() in ("null", "none") and _optional(node) else raw
        if isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node)):
            if "type" in node:  # shorthand: scheduler=slurm means scheduler.type=slurm
                key, node = key + ".type", node._get_node("type")
            else:
                raise ConfigError(f"{key!r} is a section; set one of its keys: {_describe(node)}")
        elif isinstance(node, (DictConfig, ListConfig)):  # a list or map value: YAML syntax
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"bad value for {key}={raw!r}: not YAML ({e})") from None
            expected = list if isinstance(node, ListConfig) else dict
            shape = '[list]' if expected is list else '{map}'
            if not isinstance(value, expected):
                raise ConfigError(f"bad value for {key}={raw!r}: expected a {shape}")
            element = getattr(node._metadata, "element_type", None)
            nested = next((v for v in (value.values() if expected is dict else value)
                           if isinstance(v, (dict, list))), None)
            if element in (str, int, float, bool) and nested is not None:  # (it passed the
                # update, and failed later with a traceback)
                raise ConfigError(f"bad value for {key}={raw!r}: {nested!r} is not a "
                                  f"{element.__name__}; valid: a {shape} of "
                                  f"{element.__name__} values")
            node_conf = OmegaConf.select(conf, key)
            if node_conf is not None:  # replace, do not merge, a list or map
                OmegaConf.update(conf, key, expected(), merge=False)
        _once(given, key, item)
        problem = _not_literal(value)
        if problem:
            raise ConfigError(f"{key}={raw!r} {problem}; valid: a value without '${{' (a "
                              "shell variable: $NAME) that is not '???'")
        if isinstance(node, BooleanNode) and isinstance(value, str) and value.lower() not in (
                "true", "false", "yes", "no", "on", "off", "1", "0"):  # (omegaconf: 2 is true)
            raise ConfigError(f"bad value for {key}={raw!r}: expected true or false")
        try:
            OmegaConf.update(conf, key, value, merge=True)
        except OmegaConfBaseException as e:
            msg = _expected(node, raw) or first_line(e)
            enum_type = getattr(node, "enum_type", None)
            if enum_type is not None:
                msg = f"valid values: {[m.value for m in enum_type]}"
            raise ConfigError(f"bad value for {key}={raw!r}: {msg}") from None
    bad = _out_of_range(conf)  # before any section sees it: NaN passes every `x <= 0` check
    if bad is not None:
        key, value = bad
        item = given.get(key)
        raise ConfigError(f"{item if item else f'{key}={value}'}: must be a finite number"
                          + ("" if not math.isfinite(value) else
                             f" of magnitude at most {FLOAT_LIMIT:g}"
                             + " (as seconds: 31 years)" * _in_seconds(conf, key)))
    try:
        cfg = OmegaConf.to_object(conf)  # runs every __post_init__
    except ConfigError as e:
        raise ConfigError(_with_key(conf, str(e))) from None
    except (ValueError, TypeError, OmegaConfBaseException) as e:
        raise ConfigError(first_line(e) or type(e).__name__) from None
    assert isinstance(cfg, ExperimentConfig)
    cfg.check_paths()
    return cfg


def _expected(node: Any, raw: str) -> str:
    """What a value of ``node``'s type looks like, said of ``raw`` (which it refused); empty
    for a node of another type (its own message is used)."""
    if isinstance(node, IntegerNode):
        try:
            whole = float(raw).is_integer()
        except ValueError:
            whole = False
        return "expected an integer" + (
            f" ({raw} is a float: write {int(float(raw))})" if whole else
            ", got an empty value" if not raw else "")
    if isinstance(node, FloatNode):
        return "expected a number" + (", got an empty value" if not raw else "")
    if isinstance(node, BooleanNode):
        return "expected true or false"
    return ""


SECONDS_DOC = re.compile(r"^(default )?seconds\b|\bthis many seconds\b")
"""How the docstring of a key in seconds says so ("Seconds between ...", "after this many
seconds"); not one that only mentions seconds (a KV cache's "CPU-second", a fraction's "c
seconds")."""


def _in_seconds(conf: DictConfig, key: str) -> bool:
    """Whether float key ``key`` (dotted) of ``conf`` is a time in seconds (its field's
    docstring says so: :data:`SECONDS_DOC`)."""
    section, _, leaf = key.rpartition(".")
    try:
        kind = OmegaConf.get_type(OmegaConf.select(conf, section) if section else conf)
    except Exception:  # noqa: BLE001 - only the wording of a message depends on it
        return False
    doc = field_docs(kind).get(leaf, "") if isinstance(kind, type) else ""
    return SECONDS_DOC.search(doc.lower()) is not None


def _out_of_range(node: Any, path: str = "") -> tuple[str, float] | None:
    """The first float-typed value under ``node`` that is NaN, infinite or larger in magnitude
    than :data:`FLOAT_LIMIT`, with its dotted key; None if there is none. Every float key of
    the config is a finite number: none uses inf (nor NaN) as a setting (a key without a limit
    says so with 0, or null where optional)."""
    if isinstance(node, FloatNode):
        value = node._value()
        bad = isinstance(value, float) and not (math.isfinite(value)
                                                and abs(value) <= FLOAT_LIMIT)
        return (path, value) if bad else None
    if not isinstance(node, (DictConfig, ListConfig)) or node._is_none() \
            or node._is_missing() or node._is_interpolation():
        return None
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        found = _out_of_range(node._get_node(key), f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _not_literal(value: Any) -> str | None:
    """Why OmegaConf would not keep ``value`` as it is given, or None: ``${`` starts an
    interpolation (it would be replaced by another key's value or an environment variable, and
    ``\\${`` by a literal ``${``) and ``???`` marks a missing value. Overrides are literal."""
    if isinstance(value, str):
        if "${" in value:
            return "contains '${', which the config parser reads as an interpolation"
        return "is '???', the config parser's marker of a missing value" if value == "???" \
            else None
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    if isinstance(items, list):
        return next((p for p in map(_not_literal, items) if p), None)
    return None


def _failing_section(conf: DictConfig, path: str = "") -> tuple[str, type] | None:
    """The deepest section of ``conf`` whose construction raises :class:`ConfigError`."""
    for key in conf.keys():
        node = conf._get_node(key)
        if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(node))):
            continue
        sub = f"{path}.{key}" if path else str(key)
        try:
            OmegaConf.to_object(node)
        except ConfigError:
            return _failing_section(node, sub) or (sub, OmegaConf.get_type(node))
        except (ValueError, TypeError, OmegaConfBaseException):
            continue
    return None


def _with_key(conf: DictConfig, message: str) -> str:
    """A section's error names its fields only (it does not know where it is mounted): prefix
    the dotted path of the section that raised, ``rl.weight_sync.mode=...``."""
    found = _failing_section(conf)
    if found is None:
        return message
    path, cls = found
    if message.startswith(path.split(".")[0] + "."):
        return message  # already names its full key
    first = re.match(r"[A-Za-z_]\w*", message)
    if first and first.group(0) in {f.name for f in dataclasses.fields(cls)}:
        return f"{path}.{message}"
    return f"{path}: {message}"


def _optional(node: Any) -> bool:
    try:
        return bool(node._is_optional())
    except AttributeError:
        return False
