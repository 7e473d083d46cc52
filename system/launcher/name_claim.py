"""One trial of a name per name service: the controller's liveness key names its trial
directory, and a launch finds whether another directory's trial of the same ``exp``/``trial``
is live on the same name service (a shared Redis, a shared ``name_resolve.file_root``). Its
keys would be cleared and taken over: each trial would judge the other's workers its own, and
both would fail, blaming their own workers."""
from __future__ import annotations

import json
import os
import socket

from system import names
from system.name_resolve import NameResolve


def controller_record(trial_dir: str) -> str:
    """The value of the controller's liveness key: who holds the trial's name."""
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "trial_dir": os.path.abspath(trial_dir)})


def other_trial(value: str, trial_dir: str) -> str | None:
    """``value``, a controller key not written with this trial's secret, described when it is
    another directory's (None: this directory's own earlier controller, whose secret the
    relaunch replaced)."""
    try:
        holder = json.loads(value)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return "an unknown trial directory"
    if holder.get("trial_dir") == os.path.abspath(trial_dir):
        return None
    return (f"{holder.get('trial_dir', '?')}, controller pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}")


def claim_problem(nr: NameResolve, exp: str, trial: str, trial_dir: str) -> str | None:
    """Why this trial cannot take its name on ``nr`` (another one holds it), or None."""
    value = nr.foreign(names.controller(exp, trial))
    other = None if value is None else other_trial(value, trial_dir)
    if other is None:
        return None
    return (f"trial {exp}/{trial} is live on this name service from another directory "
            f"({other}): two trials of one name would take over each other's keys; use "
            f"another trial= name, or another name service (name_resolve.*)")
