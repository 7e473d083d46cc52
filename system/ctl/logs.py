"""``logs``: print or follow one worker's log (``KIND:INDEX``), or without one the controller's
(``logs/controller.log`` of a ``--detach`` controller, ``logs/launcher.log`` of a launcher).

A worker's log is the one the controller last recorded for it (an automatic recovery's restart
writes ``<kind>-<index>.attemptN.log``), else the newest ``logs/<kind>-<index>*.log``.
``-f`` follows the file until the trial has ended (or Ctrl-C), picking up a restarted worker's
new log file."""
from __future__ import annotations

import glob
import os
import sys
import time

from system.ctl import output
from system.ctl.status import controller_log
from system.ctl.trial_state import read_trial
from system.errors import ConfigError
from system.paths import TrialPaths

FOLLOW_POLL = 0.5
"""Seconds between two reads of a followed log."""


def worker_name(spec: str) -> str:
    """``rollout:1`` or ``rollout/1`` -> ``rollout/1`` (ConfigError for anything else)."""
    kind, sep, index = spec.replace("/", ":").partition(":")
    if not sep or not kind.isidentifier() or not index.isdigit():
        raise ConfigError(f"worker {spec!r} is not KIND:INDEX (e.g. master:0, rollout:3)")
    return f"{kind}/{int(index)}"


def log_path(paths: TrialPaths, worker: str | None) -> str:
    """The log file of ``worker`` (None: the controller's); ConfigError when there is none."""
    if worker is None:
        path = controller_log(paths)
        if path is None:
            if not os.path.exists(paths.status) and not os.path.exists(paths.summary):
                raise ConfigError(f"no controller log in {paths.logs}: the trial has not run "
                                  "(a --dry-run, or a launch that stopped before its "
                                  "controller started, prepared it)")
            raise ConfigError(f"no controller log in {paths.logs}: a launcher that ran before "
                              "logs/launcher.log existed wrote only to its terminal")
        return path
    recorded = (read_trial(paths).record.get("logs") or {}).get(worker)
    if recorded and os.path.isfile(recorded):
        return recorded
    kind, index = worker.split("/")
    found = glob.glob(os.path.join(glob.escape(paths.logs), f"{kind}-{index}.*log"))
    if not found:
        raise ConfigError(f"no log of {worker} in {paths.logs}")
    return max(found, key=os.path.getmtime)


def _tail_offset(path: str, lines: int) -> int:
    """The offset where the last ``lines`` lines of ``path`` begin."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 65536 * 4))
        data = f.read()
    cut = len(data)
    for _ in range(lines + (1 if data.endswith(b"\n") else 0)):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return size - len(data)
    return size - len(data) + cut + 1


def _copy(path: str, offset: int) -> int:
    """Write ``path`` from ``offset`` to stdout; returns the new offset."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < offset:  # truncated or replaced: from the start
            offset = 0
        f.seek(offset)
        data = f.read()
    sys.stdout.buffer.write(data)
    sys.stdout.flush()
    return offset + len(data)


def _follow(paths: TrialPaths, worker: str | None, path: str, offset: int) -> None:
    """Copy what is added to ``path`` (or to the log of the worker's next attempt) until the
    trial has ended, or Ctrl-C."""
    output.say(f"==> following {path} (until the trial ends, or Ctrl-C)", sys.stderr)
    next_check = time.monotonic() + 2.0
    try:
        while True:
            time.sleep(FOLLOW_POLL)
            offset = _copy(path, offset)
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + 2.0
            newer = log_path(paths, worker)
            if newer != path:  # a restarted worker logs to its attempt's file
                output.say(f"==> {newer}", sys.stderr)
                path, offset = newer, _copy(newer, 0)
            if not read_trial(paths).live:
                _copy(path, offset)
                output.say(f"==> the trial has ended ({read_trial(paths).state})", sys.stderr)
                return
    except KeyboardInterrupt:
        return


def run(paths: TrialPaths, worker: str | None, follow: bool, lines: int | None) -> int:
    path = log_path(paths, worker)
    offset = _tail_offset(path, lines) if lines is not None else 0
    try:
        offset = _copy(path, offset)
        if follow:
            _follow(paths, worker, path, offset)
    except BrokenPipeError:  # the reader has gone (``| head``): the rest is not wanted
        output.silence(sys.stdout)
    return 0
