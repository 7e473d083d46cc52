"""CPU placement on the local scheduler (pure): which CPUs each worker may run on.

Slurm binds every task to the CPUs of its allocation (``--cpus-per-task``, its task/affinity
plugin); the local scheduler does the same with :func:`plan_cpus`, so that on a machine without
GPUs training and generation run on disjoint cores and an asynchronous trial overlaps them
instead of time-sharing every core.

``scheduler.local.cpus`` (:class:`CpuBinding`):

- ``auto`` (default): on a machine where the workers use no GPU and at least two CPUs are
  allowed, the allowed CPUs are split between the model workers and the generation servers in
  proportion to their demand (one share per model worker, ``tensor_parallel_size`` per server;
  at least one CPU each side), each worker taking a contiguous slice of its side. The master and
  the rollout workers, which mostly wait, stay free to run on every allowed CPU. With GPUs, or
  with fewer than two CPUs, nothing is bound.
- ``off`` (``scheduler.local.cpus.mode=off``): nothing is bound (every worker may run on every CPU).
- ``scheduler.local.cpus.<kind>=LIST`` (``0-3,8``) puts every worker of that kind on ``LIST``
  (its workers share it), whatever the mode; ``auto`` splits what is left between the kinds
  not given.

A worker applies its set itself (``RLSYS_CPUS``, :func:`system.cpu_binding.bind_from_env`), so a
worker forked by a warm spare gets its own set, not its spare's.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from system.cpu_binding import CPUS_ENV, parse_cpu_list
from system.errors import ConfigError

KINDS = ("master", "model", "generation", "rollout")


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``(0, 1, 2, 3, 8)`` -> ``0-3,8``."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


@dataclasses.dataclass
class CpuBinding:
    """CPU sets of the local workers (see :mod:`scheduler.cpu_plan`)."""

    mode: str = "auto"
    """auto (split the allowed CPUs between model workers and generation servers when they
    use no GPU), or off (no binding)."""
    master: str = ""
    """CPUs of the master (e.g. ``0-1``; empty: unbound, or auto)."""
    model: str = ""
    """CPUs the model workers share (e.g. ``0-3,8``; empty: auto's share, or unbound)."""
    generation: str = ""
    """CPUs the generation servers share (empty: auto's share, or unbound)."""
    rollout: str = ""
    """CPUs the rollout workers share (empty: unbound)."""

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "off"):
            raise ConfigError(f"mode={self.mode!r} is not one of auto, off")
        for kind in KINDS:
            text = getattr(self, kind)
            if text:
                try:
                    parse_cpu_list(str(text))
                except ConfigError as e:
                    raise ConfigError(f"{kind}={text!r}: {e}") from None

    def fixed(self) -> dict[str, tuple[int, ...]]:
        """The kinds given a CPU list explicitly."""
        return {k: parse_cpu_list(str(getattr(self, k))) for k in KINDS if getattr(self, k)}


@dataclasses.dataclass(frozen=True)
class CpuDemand:
    """``count`` workers of ``kind``, each weighing ``weight`` shares of the CPUs."""

    kind: str
    count: int
    weight: int = 1


def _slices(cpus: Sequence[int], weights: Sequence[int]) -> list[tuple[int, ...]]:
    """Split ``cpus`` into contiguous slices in proportion to ``weights`` (each at least one
    CPU while there are enough; with fewer CPUs than workers, workers share round-robin)."""
    if len(cpus) < len(weights):
        return [(cpus[i % len(cpus)],) for i in range(len(weights))]
    total = sum(weights)
    cuts, acc = [0], 0
    for i, w in enumerate(weights[:-1]):
        acc += w
        cut = round(len(cpus) * acc / total)
        cuts.append(min(max(cut, cuts[-1] + 1), len(cpus) - (len(weights) - 1 - i)))
    cuts.append(len(cpus))
    return [tuple(cpus[a:b]) for a, b in zip(cuts, cuts[1:])]


def plan_cpus(allowed: Sequence[int], binding: CpuBinding, demands: Sequence[CpuDemand],
              gpus: bool = False, heavy: Iterable[str] = ("model", "generation")
              ) -> dict[str, tuple[int, ...]]:
    """Each bound worker's CPUs, by worker name (``model/0``); a worker not listed is unbound.
    ``allowed``: the launcher's CPUs (its affinity); ``demands``: the workers of every kind;
    ``gpus``: the workers use GPUs (then auto binds nothing); ``heavy``: the kinds auto keeps
    apart (the experiment's compute: its training and generation workers, if it has any)."""
    fixed = binding.fixed()
    for kind, cpus in fixed.items():
        stray = sorted(set(cpus) - set(allowed))
        if stray:
            raise ConfigError(f"scheduler.local.cpus.{kind}={binding.__dict__[kind]!r}: CPUs "
                              f"{format_cpu_list(stray)} are not allowed here (allowed: "
                              f"{format_cpu_list(allowed)})")
    counts = {d.kind: d for d in demands if d.count > 0}
    out = {f"{kind}/{i}": cpus for kind, cpus in fixed.items()
           for i in range(counts[kind].count if kind in counts else 0)}
    heavy = set(heavy)
    auto = [counts[k] for k in ("model", "generation")
            if k in counts and k in heavy and k not in fixed]
    if binding.mode == "off" or gpus or not auto:
        return out
    taken = {c for cpus in fixed.values() for c in cpus
             if not set(cpus) >= set(allowed)}  # (a kind given every CPU takes none away)
    free = [c for c in allowed if c not in taken]
    sides = [k for k in ("model", "generation") if k in counts and k in heavy]
    if len(sides) < 2 or not free or len(auto) == 2 and len(free) < 2:
        return out  # nothing to keep apart, or no room to: every CPU stays shared
    workers = [(d.kind, i, d.weight) for d in auto for i in range(d.count)]
    for (kind, i, _), cpus in zip(workers, _slices(free, [w for _, _, w in workers])):
        out[f"{kind}/{i}"] = cpus
    return out


def cpu_env(plan: Mapping[str, tuple[int, ...]], name: str) -> dict[str, str]:
    """Worker ``name``'s environment for its CPU set (none: unbound)."""
    return cpus_env(plan.get(name, ()))


def cpus_env(cpus: Iterable[int]) -> dict[str, str]:
    """The environment that binds a process to ``cpus`` (none: unbound)."""
    cpus = tuple(cpus)
    return {CPUS_ENV: format_cpu_list(cpus)} if cpus else {}
