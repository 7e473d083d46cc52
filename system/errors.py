"""The project's exception hierarchy: one base, a few families, chained with ``from``."""
from __future__ import annotations


def first_line(error: BaseException | str) -> str:
    """An error's message (or a text) cut to its first line, "" when it has none: errors are
    named in one line."""
    lines = str(error).strip().splitlines()
    return lines[0].strip() if lines else ""


class RLSystemError(Exception):
    """Base of every error this system raises on purpose."""


class ConfigError(RLSystemError):
    """A configuration value or override is invalid; the message names the key."""


class UnsafeFileError(RLSystemError):
    """A file or directory that must be private (the trial's secret, the Redis password file, the
    trial directory, a user's name-resolution directory) is owned by someone else, readable or
    writable by others, or a symbolic link."""


class TrialLocked(RLSystemError):
    """Another launcher or controller holds the trial's lock: the trial is running."""


class NameResolveError(RLSystemError):
    """Name-resolution backend failure."""


class NameEntryNotFound(NameResolveError):
    """The key does not exist (or its keep-alive TTL expired)."""


class NameEntryExists(NameResolveError):
    """``add(replace=False)`` found a live entry under the key."""


class NameServiceUnavailable(NameResolveError):
    """The name-resolution server did not answer within its outage timeout."""


class NameServiceRefused(NameResolveError, ConfigError):
    """The name service answers but refuses an operation: a read-only Redis replica, its memory
    limit, an ACL, a password it asks for now; under the file backend, a full or read-only file
    system. A restart would be refused alike: a configuration error, not recovered."""


class RpcError(RLSystemError):
    """A request/reply call failed."""


class RpcTimeout(RpcError):
    """No reply arrived within the call's timeout."""


class NotSent(RpcTimeout):
    """The request itself could not be queued within the call's timeout (no connection to the
    peer takes messages): no reply can come, however long one waits."""


class ClientClosed(RpcError):
    """A call on a client that was closed (replaced: its peer registered at a new address)."""


class PeerDied(RpcError):
    """The peer a call waits on died (its heartbeat expired) before it replied."""


class CallAbandoned(RpcError):
    """The caller stopped waiting for the reply: it was asked to stop meanwhile."""


class RemoteError(RpcError):
    """The remote handler raised; carries the remote type name and traceback text."""

    def __init__(self, type_name: str, message: str, traceback_text: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_message = message
        self.traceback_text = traceback_text


class WireError(RLSystemError):
    """A message could not be encoded, decoded or authenticated."""


class FdExhausted(RLSystemError):
    """A process ran out of file descriptors (e.g. a flood of connections to its sockets)."""


class SchedulerError(RLSystemError):
    """A job could not be submitted, tracked or stopped."""


class WorkerFailure(RLSystemError):
    """A worker died, failed to register, or reported an exception. ``also``: workers that
    failed as a consequence (a peer of the dead one raised), restarted with it. ``config``: the
    worker reported a configuration error (a missing prompt file, say): restarting it would
    only fail the same way."""

    def __init__(self, message: str, worker: str | None = None, log_path: str | None = None,
                 also: tuple[str, ...] = (), config: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.log_path = log_path
        self.also = tuple(also)
        self.config = config
