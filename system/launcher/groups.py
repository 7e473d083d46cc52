"""The worker groups of a trial and what ``configure`` sends each kind (pure)."""
from __future__ import annotations

import os

from experiments.registry import Experiment
from scheduler.base import GroupSpec
from system.launcher.config import ExperimentConfig
from system.paths import TrialPaths
from system.structs import plain
from workers.kinds import KINDS
from workers.schema import WorkerSetup


def group_spec(kind: str, count: int, paths: TrialPaths, python: str, attempt: int = 0,
               first: int = 0) -> GroupSpec:
    """Workers ``first .. first+count-1`` of group ``kind`` (the whole group: ``first=0``),
    run by ``python``; ``attempt`` > 0 for a recovery's restart, whose workers log to their own
    files (pure)."""
    return GroupSpec(kind, count, (python, "-m", "system.launcher.run_worker", "--trial-dir",
                                   paths.root, "--kind", kind),
                     {"PYTHONUNBUFFERED": "1"},
                     tuple(paths.worker_log(kind, first + i, attempt) for i in range(count)),
                     first)


def group_specs(cfg: ExperimentConfig, paths: TrialPaths, python: str) -> dict[str, GroupSpec]:
    """Every worker group of the trial, by kind in start order, run by ``python`` (pure)."""
    return {kind: group_spec(kind, cfg.worker_counts()[kind], paths, python) for kind in KINDS}


def worker_configs(cfg: ExperimentConfig, experiment: Experiment) -> dict[str, WorkerSetup]:
    """What ``configure`` sends each kind: its own section, the experiment's, the counts, and
    whether to restore the latest checkpoint."""
    section = plain(getattr(cfg, experiment.section)) if experiment.section else {}
    recover = cfg.recovery()
    resume = "resume" if recover is not None and recover.resume else "off"
    return {kind: {"worker": plain(getattr(cfg, kind)), "experiment": section,
                   "counts": cfg.worker_counts(), "recover": resume,
                   "metrics": plain(cfg.metrics)}
            for kind in KINDS}


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
