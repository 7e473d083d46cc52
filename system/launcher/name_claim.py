"""One trial of a name per name service: the controller's liveness key names its trial
directory, and a launch finds whether another directory's trial of the same ``exp``/``trial``
is live on the same name service (a shared Redis, a shared ``name_resolve.file_root``). Its
keys would be cleared and taken over: each trial would judge the other's workers its own, and
both would fail, blaming their own workers. The launcher looks before it writes the trial's
directory; the controller looks again before it takes the keys."""
from __future__ import annotations

import json
import os
import socket

from system import names
from system.launcher.config import ExperimentConfig
from system.launcher.eval_mode import run_paths
from system.launcher.trial_dir import name_resolve_root
from system.name_resolve import NameResolve, make_name_resolve


def controller_record(trial_dir: str) -> str:
    """The value of the controller's liveness key: who holds the trial's name."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "trial_dir": os.path.realpath(trial_dir)})


def _same_trial(a: str, b: str) -> bool:
    """One trial's directories: the same, or one inside the other (``mode=eval`` runs under
    ``<trial>/eval``), symbolic links resolved."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def other_trial(value: str, trial_dir: str) -> str | None:
    """``value``, a live controller key, described when it is another directory's trial
    (None: this trial's, an earlier run of it whose key has not expired yet included)."""
    try:
        holder = json.loads(value)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return "an unknown trial directory"
    if isinstance(holder.get("trial_dir"), str) and _same_trial(holder["trial_dir"], trial_dir):
        return None
    return (f"{holder.get('trial_dir', '?')}, controller pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}")


def claim_problem(nr: NameResolve, exp: str, trial: str, trial_dir: str) -> str | None:
    """Why this trial cannot take its name on ``nr`` (another one holds it), or None."""
    value = nr.unverified(names.controller(exp, trial))
    other = None if value is None else other_trial(value, trial_dir)
    if other is None:
        return None
    return (f"trial {exp}/{trial} is live on this name service from another directory "
            f"({other}): two trials of one name would take over each other's keys; use "
            f"another trial= name, or another name service (name_resolve.*)")


def name_taken(cfg: ExperimentConfig) -> str | None:
    """:func:`claim_problem` for the trial ``cfg`` launches, before its directory (and its
    secret) is written: the key is read without its mac checked."""
    nr = make_name_resolve(cfg.name_resolve, name_resolve_root(cfg), None)
    try:
        return claim_problem(nr, cfg.exp, cfg.trial, run_paths(cfg).root)
    finally:
        nr.close()
