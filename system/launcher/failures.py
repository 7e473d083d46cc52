"""What the controller reads a worker failure from, and what it clears when workers restart.

Pure translations of a job's state and of a reported exception into a
:class:`~system.errors.WorkerFailure` naming the worker, its log and the cause, plus the one
side effect a restart needs: forgetting the stopped workers' name-resolution keys.
"""
from __future__ import annotations

import json
from typing import Iterable

from scheduler.base import JobStatus
from system import names
from system.errors import NameEntryNotFound, WorkerFailure, first_line
from system.launcher.groups import log_tail
from system.name_resolve import NameResolve


def job_failure(statuses: Iterable[JobStatus], phase: str,
                excluding: Iterable[str] = (), name: str | None = None) -> WorkerFailure | None:
    """The first job that is no longer active (and has none of ``excluding``'s workers), as a
    failure of ``name`` if it is one of the job's workers, else of its first worker."""
    skip = set(excluding)
    for st in statuses:
        if st.state.active or skip & set(st.workers):
            continue
        at = st.workers.index(name) if name in st.workers else 0
        log = st.log_paths[at] if at < len(st.log_paths) else None
        logs = ", ".join(st.log_paths)
        how = f"{st.state.value}" + (f" ({st.detail})" if st.detail else "")
        tail = log_tail(log) if log else ""
        return WorkerFailure(f"worker {', '.join(st.workers)} exited {phase}: {how}; "
                             f"log: {logs}" + (f"\n--- last lines ---\n{tail}" if tail else ""),
                             st.workers[at] if st.workers else "?", log)
    return None


def reported_failure(errors: dict[str, str], logs: dict[str, str]) -> WorkerFailure | None:
    """The first exception a worker published under the trial's ``error`` keys (JSON with
    ``type``, ``message``, ``traceback``; anything else is reported as it is)."""
    for key, value in errors.items():
        worker = names.worker_of(key)
        config = False
        try:
            info = json.loads(value)
            config = info.get("config") is True  # its message says it all (the log has more)
            text = f"{info['type']}: {info['message']}\n" + ("" if config else info['traceback'])
        except (ValueError, TypeError, KeyError, AttributeError):
            text = f"an unreadable error report: {value[:200]!r}\n"
        log_path = logs.get(worker)
        return WorkerFailure(f"worker {worker} raised {text}log: {log_path or '?'}", worker,
                             log_path, config=config)
    return None


def root_cause(report: WorkerFailure, statuses: Iterable[JobStatus],
               reporters: Iterable[str] = ()) -> WorkerFailure:
    """The failure to act on when a worker reported an exception: a worker whose job had
    already ended by then (killed, say) without a report of its own (``reporters``: every
    worker that reported; a reporter exits right after) is the cause, and the reporter failed
    because of it (a collective's peer closed its connection, a call to it failed); else the
    report itself. A configuration error is the failure whatever else ended (a restart would
    fail the same way)."""
    if report.worker is None or report.config:
        return report
    dead = job_failure(statuses, "before the trial completed",
                       excluding=[report.worker, *reporters])
    if dead is None:
        return report
    return _then(dead, report, also=(report.worker, *report.also))


def _then(dead: WorkerFailure, after: WorkerFailure, also: tuple[str, ...] = ()
          ) -> WorkerFailure:
    """``dead`` as the failure, with the first line of ``after`` (its consequence) last."""
    first = first_line(after)
    return WorkerFailure(f"{dead}\nthen {first}", dead.worker, dead.log_path, also=also)


def call_failure_cause(failed: WorkerFailure, statuses: Iterable[JobStatus],
                       phase: str) -> WorkerFailure | None:
    """A job that had ended when a call to a worker failed (a cancelled job's workers refuse
    calls as they stop), as the failure, with the failed call after it; None if none had. The
    called worker's own job comes first: another worker whose job ended too (one being
    restarted, say) would otherwise take the blame, and the called one go unrestarted."""
    statuses = list(statuses)
    own = [st for st in statuses if failed.worker in st.workers]
    dead = job_failure(own, phase, name=failed.worker) or job_failure(statuses, phase)
    return None if dead is None else _then(dead, failed)


def clear_worker_keys(nr: NameResolve, exp: str, trial: str, workers: Iterable[str],
                      stateful: bool) -> None:
    """Forget the stopped workers' keys (their replacements register anew) and, when
    stateful workers restart, the rendezvous and stream addresses they published (their
    replacements publish new ones)."""
    for w in workers:
        kind, index = w.split("/")
        for key in (names.worker_address(exp, trial, kind, int(index)),
                    names.heartbeat(exp, trial, kind, int(index)),
                    names.worker_error(exp, trial, kind, int(index)),
                    names.preempt(exp, trial, kind, int(index)),
                    names.stop_order(exp, trial, kind, int(index)),
                    # (a server's OpenAI endpoint: agents must not call the dead one's)
                    *([names.http_address(exp, trial, int(index))]
                      if kind == "generation" else [])):
            try:
                nr.delete(key)
            except NameEntryNotFound:
                pass
    if stateful:
        nr.clear_subtree(names.stores(exp, trial))
        nr.clear_subtree(names.streams(exp, trial))
