"""The ``redis`` name-resolution backend: a real Redis server (``SET NX PX``, native TTLs, SCAN
not KEYS); each user's keys under a prefix of their own.

A server that stops answering (restarted, failed over, a network blip) is retried for
``outage_timeout`` seconds before an operation fails with one line saying so. When it answers
again, or a new connection is made (the client reconnects by itself to a server that restarted
between two calls), and the server is a new process (its ``run_id`` changed), this process adds
back the entries it holds, in case the server came back without its data (no persistence);
keep-alive entries come back with their next refresh.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Iterator, TypeVar

from system.errors import (NameEntryExists, NameResolveError, NameServiceRefused,
                           NameServiceUnavailable, first_line)
from system.name_resolve_api import NameResolve
from system.name_resolve_config import PASSWORD_ENV

log = logging.getLogger("name_resolve")
T = TypeVar("T")
RETRY_SECONDS = 0.5
SOCKET_TIMEOUT = 3.0
"""Seconds one request (or connection) waits for a server that does not answer: then it is
retried, within the outage budget. Entries are small and answered in milliseconds; with 10 s a
frozen server (stopped, a black-holed network) made each try 10 s, past a stopping process's
3 s budget: a stop took 52 s."""


class RedisNameResolve(NameResolve):
    """Redis backend: ``SET NX PX`` for add, native TTLs, ``SCAN MATCH`` for subtrees."""

    def __init__(self, host: str, port: int, db: int = 0, password: str = "",
                 namespace: str = "rlsys", *, secret: bytes | None,
                 outage_timeout: float = 30.0) -> None:
        super().__init__(secret)
        import redis  # only this backend needs the client

        self._ns = f"{namespace.rstrip(':')}:{os.getuid()}:"  # each user's keys apart
        self._watch_error = redis.WatchError
        self._response_error = redis.ResponseError
        # (a replica whose primary is down, a busy script, a cluster resharding: as an outage)
        self._unreachable = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError,
                             redis.exceptions.MasterDownError, redis.exceptions.TryAgainError,
                             redis.exceptions.ClusterDownError)
        self._refused = (redis.exceptions.ReadOnlyError, redis.exceptions.NoPermissionError,
                         redis.exceptions.OutOfMemoryError)
        self._auth_error = redis.AuthenticationError  # (a ConnectionError: caught before it)
        self._timeout = redis.TimeoutError
        self._where = f"{host}:{port}"
        self.outage_timeout = outage_timeout
        """Seconds an unanswering server is retried before an operation fails."""
        self.restored = 0
        """Entries added back after the server restarted (see the module's docstring)."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._set_get = True  # the server takes SET ... GET (see _refresh)
        self._outage_lock = threading.Lock()
        self._local = threading.local()  # .restoring: this thread adds entries back (no retries)
        self._connected = False  # a new connection was made: is it to a new server process?
        # no retries of the client's own (they back off up to seconds): _call retries. Every
        # new connection is noted: the client reconnects by itself to a server that restarted
        # between two calls, which then never see it fail.
        self._r = redis.Redis(host=host, port=port, db=db, password=password or None,
                              socket_timeout=SOCKET_TIMEOUT,
                              socket_connect_timeout=SOCKET_TIMEOUT, decode_responses=True,
                              retry=Retry(NoBackoff(), 0), redis_connect_func=self._on_connect)
        try:
            self._run_id = self._server_run_id()
        except (redis.AuthenticationError, redis.ResponseError) as e:
            # (a missing password: AuthenticationError or NOAUTH, by protocol version)
            if password and isinstance(e, redis.AuthenticationError):
                raise NameResolveError(
                    f"redis at {host}:{port} refused the password given "
                    f"(name_resolve.redis_password_file, or {PASSWORD_ENV}): {e}") from e
            if not password and ("auth" in str(e).lower() or "NOAUTH" in str(e)):
                raise NameResolveError(
                    f"redis at {host}:{port} needs a password: set "
                    f"name_resolve.redis_password_file (or {PASSWORD_ENV}): {e}") from e
            raise NameResolveError(f"redis at {host}:{port} refused the client: {e}") from e
        except redis.RedisError as e:
            raise NameResolveError(f"cannot reach redis at {host}:{port}: {e}") from e
        self._connected = False

    def _on_connect(self, connection) -> None:
        connection.on_connect()  # what the client does by default (authentication, db)
        self._connected = True

    def _server_run_id(self) -> str:
        """The server process's id; "" where INFO is not allowed (then every return of the
        server counts as a new one: restoring is idempotent, only a round trip per entry)."""
        try:
            return str(self._r.info("server").get("run_id", ""))
        except self._response_error:
            self._r.ping()
            return ""

    def _call(self, op: Callable[[], T]) -> T:
        """``op()``, retried while the server does not answer, for up to ``outage_timeout``
        seconds (:meth:`retry_budget`: read at every retry, so a budget lowered meanwhile, by
        a process that is stopping, ends a call already retrying); once it answers again, or
        on any new connection, entries are added back if it is a new server process."""
        started = None  # when the outage began: the start of the first try that failed
        first = failures = 0
        while True:
            tried = time.monotonic()
            try:
                out = op()
            except self._auth_error as e:  # a server restarted with a password (or another)
                raise NameServiceRefused(
                    f"redis at {self._where} refused this client's password, or asks for one "
                    f"now (name_resolve.redis_password_file, or {PASSWORD_ENV}): "
                    f"{first_line(e)}") from None
            except self._unreachable as e:
                failures += 1
                # a pooled connection the server closed: once more at once (not after a
                # time-out, which waited already)
                if failures == 1 and not isinstance(e, self._timeout):
                    first = tried
                    continue
                now = self.outage_seen = time.monotonic()
                restoring = getattr(self._local, "restoring", False)
                if started is None:  # (counted from the first try: it took time too)
                    started = first or tried
                    if not restoring:
                        log.warning("redis at %s does not answer (%s): retrying for up to "
                                    "%.0fs", self._where, e, self.retry_budget())
                deadline = started + self.retry_budget()
                if restoring or now >= deadline:
                    self.gave_up()
                    raise NameServiceUnavailable(
                        f"redis at {self._where} did not answer for {now - started:.0f}s "
                        f"(name_resolve.redis_outage_timeout): {e}") from None
                time.sleep(min(RETRY_SECONDS, max(deadline - now, 0.0)))
                continue
            except self._response_error as e:
                # a read-only replica (a failover, or the wrong host), an ACL, its memory limit,
                # a failing disk (MISCONF) refuse; any other answer is the caller's
                if not isinstance(e, self._refused) and not str(e).startswith("MISCONF"):
                    raise
                raise NameServiceRefused(f"redis at {self._where} refused an operation: "
                                         f"{first_line(e)}") from None
            if (started is not None or self._connected) and \
                    not getattr(self._local, "restoring", False):
                self._check_server(outage=started is not None)
            return out

    def _check_server(self, outage: bool) -> None:
        """After an outage or a new connection: if the server is a new process (it may have
        lost every key), add back what this process holds. Another thread already checking
        is not waited for."""
        if not self._outage_lock.acquire(blocking=False):
            return
        try:
            self._connected = False
            try:
                run_id = self._server_run_id()
            except self._unreachable:
                return  # gone again: the next call's retries deal with it
            if run_id and run_id == self._run_id:
                if outage:
                    self.outage_seen = time.monotonic()
                    log.warning("redis at %s answers again", self._where)
                return
            self.outage_seen = time.monotonic()  # its heartbeats too may be gone for a while
            self._local.restoring = True
            try:
                n = self._restore_owned()
            except NameServiceUnavailable as e:  # gone again: the next return tries again
                log.warning("redis at %s: adding entries back stopped: %s", self._where, e)
                return
            finally:
                self._local.restoring = False
            self._run_id = run_id
            self.restored += n
            log.warning("redis at %s answers as a new server: %d entries of this process "
                        "added back", self._where, n)
        finally:
            self._outage_lock.release()

    def _k(self, key: str) -> str:
        return self._ns + key

    def _put(self, key: str, value: str, ttl: float | None, replace: bool) -> None:
        px = None if ttl is None else max(1, int(ttl * 1000))
        if self._call(lambda: self._r.set(self._k(key), value, px=px, nx=not replace)):
            return
        if not self._call(lambda: self._replace_refused(key, value, px)):
            raise NameEntryExists(key)

    def _refresh(self, key: str, value: str, ttl: float) -> str | None:
        px = max(1, int(ttl * 1000))
        if self._set_get:
            try:  # SET ... GET (Redis 6.2): the old value, in the same round trip
                before = self._call(lambda: self._r.set(self._k(key), value, px=px, get=True))
            except self._response_error as e:
                if "syntax" not in str(e).lower():  # (a refusal: read-only, OOM, NOPERM)
                    raise
                self._set_get = False  # a server older than 6.2: read first from now on
            else:
                return before
        return super()._refresh(key, value, ttl)

    def _give_back(self, key: str, ours: str, theirs: str, ttl: float) -> None:
        self._call(lambda: self._swap_back(key, ours, theirs, max(1, int(ttl * 1000))))

    def _swap_back(self, key: str, ours: str, theirs: str, px: int) -> None:
        with self._r.pipeline() as pipe:
            try:
                pipe.watch(self._k(key))
                if pipe.get(self._k(key)) == ours:
                    pipe.multi()
                    pipe.set(self._k(key), theirs, px=px)
                    pipe.execute()
            except self._watch_error:
                pass  # written again meanwhile: that write stands

    def _replace_refused(self, key: str, value: str, px: int | None) -> bool:
        """``add(replace=False)`` met an entry: take its place if it is not authentic, unless
        another writer changes it meanwhile (``WATCH``); False if an authentic one is there."""
        with self._r.pipeline() as pipe:
            for _ in range(5):
                try:
                    pipe.watch(self._k(key))
                    current = pipe.get(self._k(key))
                    if current == value:  # this very write, retried after a lost reply
                        return True
                    if self._sealer.open(key, current) is not None:
                        return False
                    pipe.multi()
                    pipe.set(self._k(key), value, px=px)
                    pipe.execute()
                    return True
                except self._watch_error:
                    continue
        return False

    def _get(self, key: str) -> str | None:
        return self._call(lambda: self._r.get(self._k(key)))

    def _get_many(self, keys: list[str]) -> list[tuple[str | None, float | None]]:
        def read() -> list:
            with self._r.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.get(self._k(k))
                    pipe.pttl(self._k(k))
                return pipe.execute()

        res = self._call(read)
        now = time.time()
        # PTTL: -1 no expiry, -2 gone (expired between the GET and the PTTL)
        return [(None, None) if value is None or ms == -2 else
                (value, None if ms < 0 else now + ms / 1000)
                for value, ms in zip(res[::2], res[1::2])]

    def _delete(self, key: str) -> bool:
        return bool(self._call(lambda: self._r.delete(self._k(key))))

    def _keys_under(self, prefix: str) -> Iterator[str]:
        exact = self._k(prefix)
        pattern = _glob_escape(exact) + "/*"

        def scan() -> list[str]:  # whole, so that a retry starts the SCAN over
            found = [prefix] if self._r.exists(exact) else []
            return found + [k[len(self._ns):]
                            for k in self._r.scan_iter(match=pattern, count=10_000)]

        return iter(self._call(scan))

    def close(self) -> None:
        super().close()
        self._r.close()


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)
