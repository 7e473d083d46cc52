"""``ls``: every trial under a file root with its state, step, age and scheduler."""
from __future__ import annotations

import os

from system.ctl import output
from system.ctl.trial_state import TrialView, read_trial, since
from system.paths import TrialPaths

MARKERS = ("config.yaml", "status.json", "summary.json")
"""A directory with one of these is a trial directory."""


def _is_trial(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, m)) for m in MARKERS)


def _trials_in(exp_dir: str) -> list[TrialPaths]:
    return [TrialPaths(os.path.join(exp_dir, t)) for t in sorted(os.listdir(exp_dir))
            if _is_trial(os.path.join(exp_dir, t))]


def find_trials(fileroot: str) -> list[TrialPaths]:
    """The trial directories ``<fileroot>/<exp>/<trial>/``, sorted by name. Given an
    experiment's directory (``runs/arith-tiny``) or a trial's, the trials there: not each
    trial's ``eval/`` run taken for a trial of an experiment named after the trial."""
    root = os.path.abspath(fileroot)
    if not os.path.isdir(root):
        return []
    if _is_trial(root):
        return [TrialPaths(root)]
    here = _trials_in(root)  # (an experiment's directory)
    if here:
        return here
    found = []
    for exp in sorted(os.listdir(root)):
        exp_dir = os.path.join(root, exp)
        if not exp.startswith(".") and os.path.isdir(exp_dir):
            found += _trials_in(exp_dir)
    return found


def rows(views: list[TrialView]) -> list[tuple[str, ...]]:
    return [(f"{v.exp}/{v.trial}", v.state + (" (evaluating)" if v.other_run else ""),
             v.step(), since(v.started), v.scheduler) for v in views]


def run(fileroot: str) -> int:
    views = [read_trial(p) for p in find_trials(fileroot)]
    if not views:
        output.say(f"no trials under {os.path.abspath(fileroot)}")
        return 0
    table = [("TRIAL", "STATE", "STEP", "AGE", "SCHEDULER"), *rows(views)]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        output.say("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0
