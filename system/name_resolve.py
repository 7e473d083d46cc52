"""Name resolution: where workers publish addresses, heartbeats, versions and store addresses.

Keys are slash-separated paths under ``<exp>/<trial>/`` (see :mod:`system.names`). Two backends
share one API: ``file`` (a directory, possibly on NFS: atomic write-then-rename, exclusive create
by ``link``, no file locks, TTL via expiry timestamps checked on read) and ``redis`` (a real Redis
server: native TTLs, SCAN not KEYS).

Values are authenticated with the trial's secret (:mod:`system.name_auth`): an entry not written
by a holder of the secret reads as absent. Each user has a namespace of their own: the ``file``
backend keeps a user's entries in ``<root>/<uid>/`` (mode 0700, refused unless the user owns it),
the ``redis`` backend under the key prefix ``rlsys:<uid>:``.
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import enum
import json
import os
import threading
import time
import uuid
from typing import ClassVar, Iterator, NamedTuple

from system.errors import ConfigError, NameEntryExists, NameEntryNotFound, NameResolveError
from system.name_auth import EntrySealer
from system.private_files import ensure_owned_dir, ensure_shared_dir, read_private_file

PASSWORD_ENV = "RLSYS_REDIS_PASSWORD"
"""The environment variable the Redis password may come from (see ``redis_password_file``)."""


class NameResolveBackend(str, enum.Enum):
    FILE = "file"
    REDIS = "redis"


@dataclasses.dataclass
class NameResolveConfig:
    """Where workers find each other."""

    type: NameResolveBackend = NameResolveBackend.FILE
    """Backend: ``file`` (a directory, shared filesystem on a cluster) or ``redis``."""
    file_root: str = ""
    """Directory of the ``file`` backend; empty means ``<cluster.fileroot>/.name_resolve``. Each
    user's entries live in ``<file_root>/<uid>/`` (mode 0700, refused unless owned by the user)."""
    redis_host: str = "127.0.0.1"
    """Redis server host (``redis`` backend)."""
    redis_port: int = 6379
    """Redis server port (``redis`` backend)."""
    redis_db: int = 0
    """Redis database number."""
    redis_password_file: str = ""
    """File holding the Redis password, yours and readable by you only (mode 0600 or 0400; refused
    otherwise); empty: the RLSYS_REDIS_PASSWORD environment variable, else no password. The
    password itself is never written to a config, a bootstrap file, a job script or a command
    line."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "redis_password": "a password given on the command line lands in config.yaml, job scripts "
                          "and the process list; put it in a file only you can read (chmod 600) and "
                          "set name_resolve.redis_password_file=PATH, or export "
                          f"{PASSWORD_ENV}"}

    def __post_init__(self) -> None:
        if isinstance(self.type, str):
            try:
                self.type = NameResolveBackend(self.type)
            except ValueError:
                raise ConfigError(
                    f"type={self.type!r} is not one of "
                    f"{[b.value for b in NameResolveBackend]}"
                ) from None
        if not 0 < self.redis_port < 65536:
            raise ConfigError(f"redis_port={self.redis_port} is not a valid port")
        if self.redis_password_file:  # workers may start elsewhere: keep an absolute path
            self.redis_password_file = os.path.abspath(os.path.expanduser(self.redis_password_file))


def redis_password(cfg: NameResolveConfig) -> str:
    """The Redis password: from ``cfg.redis_password_file`` (a private file of this user), else
    from the environment variable :data:`PASSWORD_ENV`, else none."""
    if not cfg.redis_password_file:
        return os.environ.get(PASSWORD_ENV, "")
    try:
        data = read_private_file(cfg.redis_password_file, "the Redis password file "
                                 "(name_resolve.redis_password_file)", (0o600, 0o400))
    except FileNotFoundError:
        raise ConfigError(f"name_resolve.redis_password_file={cfg.redis_password_file}: "
                          "no such file") from None
    return data.decode().rstrip("\r\n")


def _check_key(key: str) -> str:
    key = key.strip("/")
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise NameResolveError(f"invalid name-resolve key {key!r}")
    return key


class Entry(NamedTuple):
    """A live entry read in a batch: its value and when it expires (unix time; None: never)."""

    value: str
    expires: float | None


_VERIFIED_MAX = 100_000  # entries whose verified value is remembered (then forgotten at once)


class NameResolve(abc.ABC):
    """The name-resolution API shared by all backends. Values are sealed with ``secret`` when
    stored and checked when read (``secret=None``: stored as they are, for tools that run outside
    a trial in a private directory of their own)."""

    def __init__(self, secret: bytes | None) -> None:
        self._sealer = EntrySealer(secret)
        self._keepalive: dict[str, tuple[str, float]] = {}
        self._ka_lock = threading.Lock()
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        self._verified: dict[str, tuple[str, str]] = {}  # key -> (stored, value) checked
        self.ops: collections.Counter[str] = collections.Counter()
        """Operations issued so far: ``write`` (adds and keep-alive refreshes), ``read`` (entries
        read), ``list`` (subtree listings); for benchmarks, not exact under concurrent threads."""

    # --- backend primitives ---
    @abc.abstractmethod
    def _put(self, key: str, value: str, ttl: float | None, replace: bool) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> str | None: ...

    @abc.abstractmethod
    def _get_many(self, keys: list[str]) -> list[tuple[str | None, float | None]]:
        """The stored value and expiry (unix time; None: none) of each of ``keys``, in one
        round trip where the backend allows; ``(None, None)`` for an absent or expired one."""

    @abc.abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _keys_under(self, prefix: str) -> Iterator[str]: ...

    @property
    def refused(self) -> int:
        """Entries read so far that failed authentication (each treated as absent)."""
        return self._sealer.refused

    def _value(self, key: str) -> str | None:
        """The authentic value under ``key``; None if absent, expired or refused."""
        self.ops["read"] += 1
        return self._open(key, self._get(key))

    def _open(self, key: str, stored: str | None) -> str | None:
        """:meth:`EntrySealer.open`, but a stored value already verified under ``key`` is not
        checked again (a heartbeat's refresh stores the same sealed value every time)."""
        if stored is None:
            return None
        seen = self._verified.get(key)
        if seen is not None and seen[0] == stored:
            return seen[1]
        value = self._sealer.open(key, stored)
        if value is not None:
            if len(self._verified) >= _VERIFIED_MAX:
                self._verified.clear()
            self._verified[key] = (stored, value)
        return value

    # --- public API ---
    def add(self, key: str, value: str, *, replace: bool = False,
            keepalive_ttl: float | None = None) -> None:
        """Store ``value`` under ``key``. With ``keepalive_ttl`` the entry expires unless this
        process keeps it alive (a background thread refreshes it every ``ttl/3`` seconds)."""
        key = _check_key(key)
        if keepalive_ttl is not None and keepalive_ttl <= 0:
            raise NameResolveError(f"keepalive_ttl must be > 0, got {keepalive_ttl}")
        stored = self._sealer.seal(key, str(value))
        self.ops["write"] += 1
        self._put(key, stored, keepalive_ttl, replace)
        if keepalive_ttl is not None:
            with self._ka_lock:
                self._keepalive[key] = (stored, keepalive_ttl)
            self._ensure_keepalive_thread()

    def get(self, key: str) -> str:
        """The live value under ``key``; :class:`NameEntryNotFound` if absent or expired."""
        value = self._value(_check_key(key))
        if value is None:
            raise NameEntryNotFound(key)
        return value

    def wait(self, key: str, timeout: float | None = None, poll: float = 0.05) -> str:
        """Block until ``key`` exists; :class:`NameEntryNotFound` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            value = self._value(_check_key(key))
            if value is not None:
                return value
            if deadline is not None and time.monotonic() >= deadline:
                raise NameEntryNotFound(f"{key} (waited {timeout:.1f}s)")
            time.sleep(poll)

    def read_many(self, keys: list[str]) -> dict[str, Entry]:
        """``{key: Entry}`` of those of ``keys`` that are live, read in one batch (one round
        trip with redis); absent, expired and refused ones are left out."""
        keys = [_check_key(k) for k in keys]
        self.ops["read"] += len(keys)
        out = {}
        for k, (stored, expires) in zip(keys, self._get_many(keys) if keys else []):
            value = self._open(k, stored)
            if value is not None:
                out[k] = Entry(value, expires)
        return out

    def find_subtree(self, prefix: str) -> list[str]:
        """Sorted keys of live entries at or below ``prefix``."""
        return list(self.get_subtree(prefix))

    def get_subtree(self, prefix: str) -> dict[str, str]:
        """``{key: value}`` of live entries at or below ``prefix``, sorted by key."""
        self.ops["list"] += 1
        keys = sorted(self._keys_under(_check_key(prefix)))
        return {k: e.value for k, e in self.read_many(keys).items()}

    def delete(self, key: str) -> None:
        """Remove ``key`` (and stop keeping it alive); :class:`NameEntryNotFound` if absent."""
        key = _check_key(key)
        with self._ka_lock:
            self._keepalive.pop(key, None)
        if not self._delete(key):
            raise NameEntryNotFound(key)

    def clear_subtree(self, prefix: str) -> int:
        """Remove every key at or below ``prefix`` (e.g. a whole trial); returns how many."""
        prefix = _check_key(prefix)
        with self._ka_lock:
            for k in [k for k in self._keepalive if k == prefix or k.startswith(prefix + "/")]:
                del self._keepalive[k]
        n = 0
        for k in list(self._keys_under(prefix)):
            n += int(self._delete(k))
        return n

    def close(self) -> None:
        """Stop keep-alive refreshes (entries then expire on their own)."""
        self._ka_stop.set()
        if self._ka_thread is not None:
            self._ka_thread.join(timeout=5)

    # --- keep-alive ---
    def _ensure_keepalive_thread(self) -> None:
        if self._ka_thread is None or not self._ka_thread.is_alive():
            self._ka_stop.clear()
            self._ka_thread = threading.Thread(target=self._keepalive_loop, name="name-resolve-keepalive",
                                               daemon=True)
            self._ka_thread.start()

    def _keepalive_loop(self) -> None:
        while not self._ka_stop.is_set():
            with self._ka_lock:
                items = list(self._keepalive.items())
                period = min((ttl for _, ttl in self._keepalive.values()), default=1.0) / 3
            for key, (value, ttl) in items:
                try:
                    self.ops["write"] += 1
                    self._put(key, value, ttl, True)
                except Exception:  # a transient backend error must not kill the refresher
                    pass
            self._ka_stop.wait(max(period, 0.02))


class FileNameResolve(NameResolve):
    """Directory backend. Each key is a directory holding an ``ENTRY`` JSON file
    ``{"value": ..., "expires": unix_time|null}``; writes go to a temp file renamed into place.
    ``root`` is shared by every user of a file root (created 1777, like ``/tmp``, when absent);
    this user's entries live in ``root/<uid>/``, a directory of theirs with mode 0700."""

    ENTRY = "ENTRY"

    def __init__(self, root: str, *, secret: bytes | None) -> None:
        super().__init__(secret)
        shared = os.path.abspath(root)
        try:
            ensure_shared_dir(shared)
            self.root = ensure_owned_dir(os.path.join(shared, str(os.getuid())), 0o700,
                                         "your name-resolution directory")
        except PermissionError as e:
            raise NameResolveError(
                f"cannot create your name-resolution directory in {shared} ({e.strerror}): its "
                "owner can make it shared (chmod 1777), or set name_resolve.file_root to a "
                "directory of yours") from e

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"), self.ENTRY)

    def _put(self, key: str, value: str, ttl: float | None, replace: bool) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        body = json.dumps({"value": value, "expires": None if ttl is None else time.time() + ttl})
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        try:
            if replace:
                os.replace(tmp, path)
                return
            try:  # exclusive create: link() fails if the target exists (atomic on NFS too)
                os.link(tmp, path)
                return
            except FileExistsError:
                if self._sealer.open(key, self._read(path)[0]) is not None:
                    raise NameEntryExists(key) from None
                os.replace(tmp, path)  # the old entry had expired (or was not authentic)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def _read(path: str) -> tuple[str | None, float | None]:
        """The value and expiry in the entry file ``path``; ``(None, None)`` if absent or
        expired."""
        try:
            with open(path) as f:
                entry = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        except (json.JSONDecodeError, OSError, UnicodeDecodeError):
            return None, None  # torn or foreign file: treat as absent
        if not isinstance(entry, dict):
            return None, None
        expires = entry.get("expires")
        if not isinstance(expires, (int, float)):
            expires = None
        elif time.time() > expires:
            return None, None
        value = entry.get("value")
        return (value, expires) if isinstance(value, str) else (None, None)

    def _get(self, key: str) -> str | None:
        return self._read(self._path(key))[0]

    def _get_many(self, keys: list[str]) -> list[tuple[str | None, float | None]]:
        return [self._read(self._path(k)) for k in keys]

    def _delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        # prune now-empty directories up to the root
        d = os.path.dirname(path)
        while d != self.root and d.startswith(self.root):
            try:
                os.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)
        return True

    def _keys_under(self, prefix: str) -> Iterator[str]:
        top = os.path.join(self.root, *prefix.split("/"))
        if not os.path.isdir(top):
            return
        for dirpath, _dirs, files in os.walk(top):
            if self.ENTRY in files:
                yield os.path.relpath(dirpath, self.root).replace(os.sep, "/")


class RedisNameResolve(NameResolve):
    """Redis backend: ``SET NX PX`` for add, native TTLs, ``SCAN MATCH`` for subtrees."""

    def __init__(self, host: str, port: int, db: int = 0, password: str = "",
                 namespace: str = "rlsys", *, secret: bytes | None) -> None:
        super().__init__(secret)
        import redis  # only this backend needs the client

        self._ns = f"{namespace.rstrip(':')}:{os.getuid()}:"  # each user's keys apart
        self._watch_error = redis.WatchError
        self._r = redis.Redis(host=host, port=port, db=db, password=password or None,
                              socket_timeout=10, socket_connect_timeout=10, decode_responses=True)
        try:
            self._r.ping()
        except redis.RedisError as e:
            raise NameResolveError(f"cannot reach redis at {host}:{port}: {e}") from e

    def _k(self, key: str) -> str:
        return self._ns + key

    def _put(self, key: str, value: str, ttl: float | None, replace: bool) -> None:
        px = None if ttl is None else max(1, int(ttl * 1000))
        if self._r.set(self._k(key), value, px=px, nx=not replace):
            return
        if not self._replace_refused(key, value, px):
            raise NameEntryExists(key)

    def _replace_refused(self, key: str, value: str, px: int | None) -> bool:
        """``add(replace=False)`` met an entry: take its place if it is not authentic, unless
        another writer changes it meanwhile (``WATCH``); False if an authentic one is there."""
        with self._r.pipeline() as pipe:
            for _ in range(5):
                try:
                    pipe.watch(self._k(key))
                    if self._sealer.open(key, pipe.get(self._k(key))) is not None:
                        return False
                    pipe.multi()
                    pipe.set(self._k(key), value, px=px)
                    pipe.execute()
                    return True
                except self._watch_error:
                    continue
        return False

    def _get(self, key: str) -> str | None:
        return self._r.get(self._k(key))

    def _get_many(self, keys: list[str]) -> list[tuple[str | None, float | None]]:
        with self._r.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.get(self._k(k))
                pipe.pttl(self._k(k))
            res = pipe.execute()
        now = time.time()
        # PTTL: -1 no expiry, -2 gone (expired between the GET and the PTTL)
        return [(None, None) if value is None or ms == -2 else
                (value, None if ms < 0 else now + ms / 1000)
                for value, ms in zip(res[::2], res[1::2])]

    def _delete(self, key: str) -> bool:
        return bool(self._r.delete(self._k(key)))

    def _keys_under(self, prefix: str) -> Iterator[str]:
        exact = self._k(prefix)
        if self._r.exists(exact):
            yield prefix
        pattern = _glob_escape(exact) + "/*"
        for k in self._r.scan_iter(match=pattern, count=10_000):
            yield k[len(self._ns):]

    def close(self) -> None:
        super().close()
        self._r.close()


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def make_name_resolve(cfg: NameResolveConfig, default_file_root: str, secret: bytes
                      ) -> NameResolve:
    """Build the backend named by ``cfg`` for the trial whose secret is ``secret``."""
    if cfg.type == NameResolveBackend.FILE:
        return FileNameResolve(cfg.file_root or default_file_root, secret=secret)
    return RedisNameResolve(cfg.redis_host, cfg.redis_port, cfg.redis_db, redis_password(cfg),
                            secret=secret)
