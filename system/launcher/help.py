"""``--help``: the experiments, and every key of an experiment's config, at every depth, with
its default and the documentation its dataclass field carries (the string literal after the
field)."""
from __future__ import annotations

import dataclasses
import enum
import textwrap
from typing import Any, Iterator

from experiments.catalog import all_experiments, get_experiment
from system.launcher.config import ExperimentConfig
from system.structs import field_docs

WIDTH = 100


@dataclasses.dataclass(frozen=True)
class Key:
    """One entry of the help: a section (``value`` is None) or a leaf key with its default."""

    path: str
    doc: str
    section: bool
    default: Any = None
    choices: tuple[str, ...] = ()


def walk(cfg: Any, prefix: str = "") -> Iterator[Key]:
    """Every section and leaf key of the dataclass instance ``cfg``, depth first."""
    docs = field_docs(type(cfg))
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            yield Key(path, docs.get(f.name, ""), True)
            yield from walk(value, path + ".")
        elif isinstance(value, enum.Enum):
            yield Key(path, docs.get(f.name, ""), False, value.value,
                      tuple(str(m.value) for m in type(value)))
        else:
            yield Key(path, docs.get(f.name, ""), False, value)


def leaf_keys(cfg: Any) -> list[str]:
    return [k.path for k in walk(cfg) if not k.section]


def render(keys: list[Key]) -> list[str]:
    """A section is a heading; a leaf is ``path = default`` with its doc wrapped below it."""
    lines: list[str] = []
    for k in keys:
        if k.section:
            lines += ["", f"{k.path}:  {k.doc}".rstrip()]
            continue
        head = f"  {k.path} = {k.default!r}"
        if k.choices:
            head += f"  (one of: {', '.join(k.choices)})"
        lines.append(head)
        if k.doc:
            lines += textwrap.wrap(k.doc, WIDTH, break_on_hyphens=False, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return lines


def describe(cfg: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The help lines of ``cfg``, leaving out the top-level fields in ``skip``."""
    return render([k for k in walk(cfg) if k.path.split(".")[0] not in skip])


def help_text(exp: str = "") -> str:
    """``python -m system.launch --help`` (``exp``: with that experiment's keys alone)."""
    lines = ["Start a trial.", "",
             "usage: python -m system.launch exp=NAME trial=T [key=value ...] [--dry-run] "
             "[--test-only] [--detach] [--help]",
             "", "experiments:"]
    lines += [f"  {e.name:<14} {e.doc.splitlines()[0] if e.doc else ''}"
              for e in all_experiments().values()]
    lines += ["", "Set a key with its dotted path (rollout.count=8); a section with a type key "
              "takes it as shorthand (scheduler=slurm)."]
    if exp:
        lines += ["", f"keys of {exp}:", *describe(get_experiment(exp).make_config())]
        return "\n".join(lines)
    base = ExperimentConfig()
    lines += ["", "keys of every experiment:", *describe(base)]
    shared = {f.name for f in dataclasses.fields(base)}
    for names, cfg in _own_sections(shared):
        lines += ["", f"keys of {', '.join(names)} only (defaults of {names[0]}; "
                  f"exp={names[0]} --help shows its own):",
                  *describe(cfg, skip=tuple(shared))]
    return "\n".join(lines)


def _own_sections(shared: set[str]) -> list[tuple[list[str], ExperimentConfig]]:
    """Experiments grouped by the config class that adds sections to the shared ones."""
    groups: dict[type, tuple[list[str], ExperimentConfig]] = {}
    for e in all_experiments().values():
        cfg = e.make_config()
        if {f.name for f in dataclasses.fields(cfg)} - shared:
            groups.setdefault(type(cfg), ([], cfg))[0].append(e.name)
    return list(groups.values())
