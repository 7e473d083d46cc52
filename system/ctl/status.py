"""``status``: one trial's jobs (id, state, pending reason, node), which workers are alive, its
progress and last metrics, its last error and its log paths.

Exit codes (:data:`EXIT_CODES`): 0 while the trial is live (pending, starting, running,
stopping); 1 failed; 2 a usage error or no such trial; 3 completed; 4 interrupted; 5 cancelled;
6 lost (the controller died without recording an end); 7 unknown (never ran).
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from system.ctl import output, procs, slurm_query
from system.ctl.live import LiveView, read_live
from system.ctl.trial_state import TrialView, read_trial, since
from system.errors import first_line
from system.paths import TrialPaths

EXIT_CODES = {"pending": 0, "starting": 0, "running": 0, "stopping": 0, "failed": 1,
              "completed": 3, "interrupted": 4, "cancelled": 5, "lost": 6, "unknown": 7}


def controller_log(paths: TrialPaths) -> str | None:
    """The controller's log: ``logs/controller.log`` (a ``--detach`` controller's job output)
    or ``logs/launcher.log`` (a launcher's own copy of what it printed), the newer of the two."""
    found = [p for p in (os.path.join(paths.logs, "controller.log"),
                         os.path.join(paths.logs, "launcher.log")) if os.path.isfile(p)]
    return max(found, key=os.path.getmtime) if found else None


ONGOING = ("RUNNING", "PENDING", "")
"""Recorded job states that are no end: what the job is now is checked (:func:`jobs`)."""


def _unchecked(recorded: str, live: bool) -> str:
    """A job whose state cannot be checked from here (no answer from ``squeue``; a local pid on
    another host): as recorded while the trial is live (``status.json`` is seconds old), and
    UNKNOWN once the controller has gone if the record still has it running."""
    return "UNKNOWN" if recorded in ONGOING and not live else recorded


def _local_state(job: dict[str, Any], root: str) -> str:
    """RUNNING while the job's pid runs a worker of the trial in ``root``, else the end the
    controller recorded, or EXITED (gone without one: a lost trial's workers die with it)."""
    args = procs.cmdline(int(job["id"])) if str(job["id"]).isdigit() else None
    if args is not None and procs.is_worker(args, root):
        return "RUNNING"
    return "EXITED" if job["state"] in ONGOING else job["state"]


def jobs(view: TrialView) -> list[dict[str, Any]]:
    """The recorded jobs (the controller's own job first, with ``--detach``), their states
    checked now, live trial or not: ``squeue`` for Slurm (GONE: no longer listed),
    ``/proc`` for local pids when ``status`` runs on the controller's host."""
    rows = [{"id": str(j["id"]), "workers": list(j["workers"]), "state": j.get("state", ""),
             "reason": "", "node": ""} for j in view.record.get("jobs") or []]
    controller = (view.record.get("controller") or {})
    if controller.get("slurm_job"):
        rows.insert(0, {"id": controller["slurm_job"], "workers": ["controller"],
                        "state": "", "reason": "", "node": ""})
    if view.scheduler == "slurm":
        queued = slurm_query.queue([r["id"] for r in rows], all_states=True)
        for r in rows:
            q = (queued or {}).get(r["id"])
            if q is not None:
                r.update(state=q.state, reason=q.reason, node=q.node)
            elif queued is None:
                r["state"] = _unchecked(r["state"], view.live)
            elif r["state"] in ONGOING:
                r["state"] = "GONE"
    else:
        host = str(controller.get("host") or "")
        here = host in ("", socket.gethostname())
        for r in rows:
            r["node"] = host
            r["state"] = (_local_state(r, view.paths.root) if here
                          else _unchecked(r["state"], view.live))
    return rows


def last_metrics(root: str) -> dict[str, Any]:
    """The last row of the trial's ``metrics.jsonl`` (the RL experiments), or nothing."""
    path = os.path.join(root, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            return row
    return {}


def gather(view: TrialView) -> dict[str, Any]:
    """Everything ``status`` shows, as JSON-able data."""
    live = read_live(view.paths, view.exp, view.trial) if view.live else LiveView()
    logs = dict(view.record.get("logs") or {})
    expected = sorted(logs) or sorted(f"{k}/{i}" for k, n in (view.record.get(
        "workers") or {}).items() for i in range(int(n))) or sorted(live.heartbeats)
    failure = view.record.get("failure") or (view.summary or {}).get("failure")
    errors = {w: f"{e.get('type', 'error')}: {e.get('message', '')}"
              for w, e in live.errors.items()}
    recoveries = list(view.record.get("recoveries") or [])
    last_error = (failure or {}).get("message", "") or (
        f"{recoveries[-1].get('cause', '')} (recovered; recoveries so far: {len(recoveries)})"
        if recoveries else "")
    for worker, message in errors.items():  # a live report is newer than any recorded end
        last_error = f"{worker}: {message}"
    return {
        "trial": f"{view.exp}/{view.trial}", "dir": view.paths.root, "state": view.state,
        "phase": view.record.get("phase", ""), "scheduler": view.scheduler,
        "started": view.started, "updated": float(view.record.get("updated") or 0.0),
        "controller": {**(view.record.get("controller") or {}), "lock_holder": view.holder,
                       "key_live": None if live.problem else live.controller},
        "cancel_request": view.cancel, "other_run": view.other_line(), "jobs": jobs(view),
        # (unknown where name resolution cannot be read: every worker was shown missing)
        "workers": {"expected": expected,
                    "alive": None if live.problem else sorted(live.heartbeats),
                    "missing": None if live.problem else
                    [w for w in expected if w not in live.heartbeats]},
        "progress": live.progress or dict(view.record.get("progress") or {}),
        "metrics": last_metrics(view.paths.root), "errors": errors, "last_error": last_error,
        "recoveries": recoveries, "endpoints": live.endpoints,
        "logs": {"controller": controller_log(view.paths), **logs},
        "name_resolution": live.problem or "ok"}


def render(s: dict[str, Any]) -> str:
    c = s["controller"]
    where = (f"pid {c.get('pid')} on {c.get('host')}" if c.get("pid") else "not started")
    if c.get("slurm_job"):
        where += f", Slurm job {c['slurm_job']}"
    lines = [f"{s['trial']}: {s['state']} (phase {s['phase'] or '-'}, started "
             f"{since(s['started'])} ago, status.json updated {since(s['updated'])} ago)",
             f"  dir: {s['dir']}", f"  scheduler: {s['scheduler']}; controller: {where}"
             + (" (alive)" if c.get("lock_holder") else "")]
    if s["other_run"]:
        lines.append(f"  {s['other_run']}")
    lines.append("  jobs:")
    for j in s["jobs"]:
        reason = f" reason={j['reason']}" if j["reason"] else ""
        lines.append(f"    {j['id']:>8}  {j['state'] or '?':<10} {','.join(j['workers'])}"
                     f"{reason}" + (f" node={j['node']}" if j["node"] else ""))
    w = s["workers"]
    if s["state"] in EXIT_CODES and EXIT_CODES[s["state"]] == 0:
        if s["name_resolution"] != "ok":
            lines.append(f"  workers alive (heartbeat): unknown ({s['name_resolution']})")
        else:
            lines.append(f"  workers alive (heartbeat): {len(w['alive'])}/{len(w['expected'])}"
                         + (f"; missing: {', '.join(w['missing'])}" if w["missing"] else ""))
    if s["progress"]:
        lines.append("  progress: " + ", ".join(f"{k} {v}" for k, v in s["progress"].items()
                                                 if v is not None))
    if s["metrics"]:
        lines.append("  last metrics: " + ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in s["metrics"].items()))
    if s["endpoints"]:
        lines.append("  OpenAI endpoints (key: the trial's api_key file): " + ", ".join(
            f"generation/{i} {url}" for i, url in s["endpoints"].items()))
    if s["last_error"]:
        lines.append(f"  last error: {first_line(s['last_error'])}")
    lines.append("  logs:")
    lines += [f"    {k}: {v}" for k, v in s["logs"].items() if v]
    return "\n".join(lines)


def run(paths: TrialPaths, as_json: bool) -> int:
    s = gather(read_trial(paths))
    s["time"] = time.time()
    output.say(json.dumps(s, indent=1, default=str) if as_json else render(s))
    return EXIT_CODES.get(s["state"], 7)
