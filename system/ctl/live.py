"""What name resolution says of a running trial: live heartbeats, the controller's liveness
key, the master's progress, the errors workers reported; and the cancel request key. The backend
and its root come from the trial's ``bootstrap.json`` (as every worker reads them), the secret
from the trial's ``secret`` file: entries are authenticated, so only the trial's user reads
them."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from system import names
from system.bootstrap import Bootstrap, read_secret
from system.errors import NameEntryNotFound, RLSystemError
from system.name_resolve import NameResolve, NameResolveConfig, make_name_resolve
from system.paths import TrialPaths


def open_name_resolve(paths: TrialPaths) -> NameResolve:
    """The trial's name resolution (RLSystemError or OSError when it cannot be reached)."""
    boot = Bootstrap.read(paths.bootstrap)
    return make_name_resolve(NameResolveConfig(**boot.name_resolve), boot.name_resolve_root,
                             read_secret(paths.secret))


@dataclasses.dataclass(frozen=True)
class LiveView:
    """The trial's live keys; ``problem`` says why they could not be read (then all empty)."""

    heartbeats: tuple[str, ...] = ()
    """Workers (``kind/index``) whose heartbeat is live."""
    controller: bool = False
    """The controller's liveness key is live."""
    progress: dict[str, Any] = dataclasses.field(default_factory=dict)
    errors: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Worker -> its reported error ``{"type", "message", "traceback"}``."""
    endpoints: dict[str, str] = dataclasses.field(default_factory=dict)
    """Generation server index -> its OpenAI-compatible endpoint (``http://host:port``), for
    the servers whose heartbeat is live."""
    problem: str = ""


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"message": text}
    return value if isinstance(value, dict) else {"message": text}


def read_live(paths: TrialPaths, exp: str, trial: str) -> LiveView:
    try:
        nr = open_name_resolve(paths)
    except (RLSystemError, OSError, TypeError, ValueError) as e:
        return LiveView(problem=f"name resolution not readable: {e}")
    try:
        hb = names.heartbeats(exp, trial)
        beating = tuple(k[len(hb) + 1:] for k in nr.find_subtree(hb))
        try:
            nr.get(names.controller(exp, trial))
            controller = True
        except NameEntryNotFound:
            controller = False
        try:
            progress = _json(nr.get(names.progress(exp, trial)))
        except NameEntryNotFound:
            progress = {}
        err = names.worker_errors(exp, trial)
        errors = {k[len(err) + 1:]: _json(v) for k, v in nr.get_subtree(err).items()}
        http = names.http_addresses(exp, trial)
        found = {k[len(http) + 1:]: v for k, v in nr.get_subtree(http).items()}
        # a server's key outlives it: only those whose worker beats are shown
        endpoints = {i: found[i] for i in sorted(found, key=lambda i: (len(i), i))
                     if f"generation/{i}" in beating}
        return LiveView(beating, controller, progress, errors, endpoints)
    except Exception as e:  # the backend's own errors too (redis-py raises its own types)
        return LiveView(problem=f"name resolution not readable: {e}")
    finally:
        nr.close()


def request_cancel(paths: TrialPaths, exp: str, trial: str, note: str) -> str:
    """Set the trial's cancel key (the running controller stops the trial when it sees it);
    returns why it could not be set, or an empty string."""
    try:
        nr = open_name_resolve(paths)
    except (RLSystemError, OSError, TypeError, ValueError) as e:
        return str(e)
    try:
        nr.add(names.cancel(exp, trial), note, replace=True)
        return ""
    except Exception as e:  # the backend's own errors too (redis-py raises its own types)
        return str(e)
    finally:
        nr.close()
