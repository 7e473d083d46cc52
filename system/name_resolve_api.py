"""Name resolution's API: the abstract store every backend implements (authenticated values,
TTLs, keep-alive refreshes, batch reads, subtrees); its configuration is
:mod:`system.name_resolve_config`.

See :mod:`system.name_resolve` for the backends and how one is chosen.
"""
from __future__ import annotations

import abc
import collections
import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, NamedTuple

from system.errors import NameEntryExists, NameEntryNotFound, NameResolveError, first_line
from system.name_auth import EntrySealer, unverified_value

log = logging.getLogger("name_resolve")

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
        # held by a keep-alive refresh while it writes, and by delete/clear while they drop
        # keys from keep-alive: a refresh never writes back a key just deleted
        self._ka_put_lock = threading.RLock()  # (a refresh's call may add entries back)
        self._ka_thread: threading.Thread | None = None
        self._ka_stop = threading.Event()
        self._ka_failing = ""  # the kind of error the last refresh failed with ("": none)
        self._verified: dict[str, tuple[str, str]] = {}  # key -> (stored, value) checked
        self._owned: dict[str, str] = {}  # key -> stored value, of entries added without TTL
        self.outage_timeout = 0.0
        """Seconds a backend that retries an unanswering server (redis) keeps trying; a
        process that stops lowers it (:meth:`stopping`), which also ends calls retrying."""
        self._budget = threading.local()  # .seconds: this thread's own cap on retries
        self._stopping = False
        self._refreshed: dict[str, float] = {}  # keep-alive key -> last write (monotonic)
        self._stood_still: set[str] = set()  # keep-alive keys refreshed after this process
        # stood still (see _keepalive_loop); when the keep-alive thread last ran (monotonic)
        self._ka_alive = time.monotonic()
        self.outage_seen: float | None = None
        """When (monotonic) a call of this process last found the backend not answering, or
        answering again after that (None: never): heartbeats missed meanwhile are no news
        until their owners refreshed them."""
        self.ops: collections.Counter[str] = collections.Counter()
        """Operations issued so far: ``write`` (adds and keep-alive refreshes), ``read`` (entries
        read), ``list`` (subtree listings); for benchmarks, not exact under concurrent threads."""

    # --- backend primitives ---
    @abc.abstractmethod
    def _put(self, key: str, value: str, ttl: float | None, replace: bool) -> None: ...

    def _refresh(self, key: str, value: str, ttl: float) -> str | None:
        """Write a keep-alive entry again (``_put`` with ``replace``); the stored value found
        before (None: the backend lost it). Backends override it to tell in one operation;
        this default reads first."""
        before = self._get(key)
        self._put(key, value, ttl, True)
        return before

    def _give_back(self, key: str, ours: str, theirs: str, ttl: float) -> None:
        """Undo a refresh that wrote ``ours`` over another process's ``theirs``, unless the
        entry changed since (this default reads first: a write in between is theirs again)."""
        if self._get(key) == ours:
            self._put(key, theirs, ttl, True)

    def _taken(self, key: str, value: str, stored: str | None) -> bool:
        """Whether ``stored``, found under ``key`` where this process keeps ``value`` alive,
        is another process's: authentic, and another value (a replacement of a worker that
        stood still past its TTL registered since)."""
        return stored is not None and stored != value and self._sealer.authentic(key, stored)

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
        # a keep-alive key's: not between a refresh's snapshot and its write (it would write
        # the old value back, then take it for another process's)
        with self._ka_put_lock if keepalive_ttl is not None else contextlib.nullcontext():
            self._put(key, stored, keepalive_ttl, replace)
            with self._ka_lock:
                if keepalive_ttl is not None:
                    self._keepalive[key] = (stored, keepalive_ttl)
                    self._refreshed[key] = time.monotonic()
                    self._stood_still.discard(key)
                    self._owned.pop(key, None)
                else:
                    self._owned[key] = stored
        if keepalive_ttl is not None:
            self._ensure_keepalive_thread()

    def get(self, key: str) -> str:
        """The live value under ``key``; :class:`NameEntryNotFound` if absent or expired."""
        value = self._value(_check_key(key))
        if value is None:
            raise NameEntryNotFound(key)
        return value

    def unverified(self, key: str) -> str | None:
        """The value of the live entry under ``key``, its mac NOT checked (another trial's of
        the same name reads so; for a message about who holds a name, never to act on as
        this trial's), or None. Nothing is counted."""
        stored = self._get(_check_key(key))
        return None if stored is None else unverified_value(stored)

    def wait(self, key: str, timeout: float | None = None, poll: float = 0.05,
             stop: Callable[[], bool] | None = None) -> str:
        """Block until ``key`` exists; :class:`NameEntryNotFound` after ``timeout`` seconds, or
        as soon as ``stop()`` says to wait no longer (a worker told to stop)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            value = self._value(_check_key(key))
            if value is not None:
                return value
            if deadline is not None and time.monotonic() >= deadline:
                raise NameEntryNotFound(f"{key} (waited {timeout:.1f}s)")
            if stop is not None and stop():
                raise NameEntryNotFound(f"{key} (no longer waited for: stopping)")
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
        with self._ka_put_lock, self._ka_lock:
            self._keepalive.pop(key, None)
            self._refreshed.pop(key, None)
            self._stood_still.discard(key)
            self._owned.pop(key, None)
        if not self._delete(key):
            raise NameEntryNotFound(key)

    def forget(self, key: str) -> None:
        """Stop holding ``key`` (not refreshed, not added back after the backend lost it):
        another process consumed it (a request it deletes once answered)."""
        key = _check_key(key)
        with self._ka_put_lock, self._ka_lock:
            self._keepalive.pop(key, None)
            self._refreshed.pop(key, None)
            self._stood_still.discard(key)
            self._owned.pop(key, None)

    def release(self, key: str) -> None:
        """Stop keeping ``key`` alive: the entry stays until its TTL ends (or it is deleted)."""
        key = _check_key(key)
        with self._ka_put_lock, self._ka_lock:
            self._keepalive.pop(key, None)
            self._refreshed.pop(key, None)
            self._stood_still.discard(key)

    def clear_subtree(self, prefix: str) -> int:
        """Remove every key at or below ``prefix`` (e.g. a whole trial); returns how many."""
        prefix = _check_key(prefix)
        with self._ka_put_lock, self._ka_lock:
            for held in (self._keepalive, self._refreshed, self._owned):
                for k in [k for k in held if k == prefix or k.startswith(prefix + "/")]:
                    del held[k]
            self._stood_still = {k for k in self._stood_still
                                 if k != prefix and not k.startswith(prefix + "/")}
        n = 0
        for k in list(self._keys_under(prefix)):
            n += int(self._delete(k))
        return n

    def retry_budget(self) -> float:
        """Seconds a call of this thread retries an unanswering backend: ``outage_timeout``,
        or less in the keep-alive thread (a refresh that fails is made again next period)."""
        own = getattr(self._budget, "seconds", None)
        return self.outage_timeout if own is None else min(own, self.outage_timeout)

    def stopping(self, wait: float) -> None:
        """This process is stopping: no call waits longer than ``wait`` seconds for a backend
        that does not answer from now on, those retrying already included; once one has
        waited in vain, the others try once (see :meth:`gave_up`)."""
        self.outage_timeout = min(self.outage_timeout, wait)
        self._stopping = True

    def gave_up(self) -> None:
        """A call failed for want of an answer: while stopping, the next ones wait no more
        (each of a stopping worker's clean-ups would wait its own ``wait`` in turn)."""
        if self._stopping:
            self.outage_timeout = 0.0

    def outage_within(self, seconds: float) -> bool:
        """Whether a call of this process found the backend down (or back from it) less than
        ``seconds`` ago: heartbeats missed meanwhile are no news yet."""
        seen = self.outage_seen
        return seen is not None and time.monotonic() - seen < seconds

    def _restore_owned(self) -> int:
        """Add again, where missing, every entry this process added and still holds (after the
        backend lost its data: a Redis server restarted without persistence); keep-alive ones
        come back with their next refresh. Returns how many were added."""
        with self._ka_lock:
            items = list(self._owned.items())
        n = 0
        for key, stored in items:
            with self._ka_put_lock:  # (not one this process deletes or forgets meanwhile)
                with self._ka_lock:
                    if self._owned.get(key) != stored:
                        continue
                try:
                    if self._get(key) == stored:  # (kept: the count is of those added back)
                        continue
                    self._put(key, stored, None, False)
                    n += 1
                except NameEntryExists:  # there (kept, or written anew by its new owner)
                    pass
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
            self._ka_alive = time.monotonic()
            self._ka_thread = threading.Thread(target=self._keepalive_loop,
                                               name="name-resolve-keepalive", daemon=True)
            self._ka_thread.start()

    def _keepalive_loop(self) -> None:
        while not self._ka_stop.is_set():
            with self._ka_lock:
                items = list(self._keepalive.items())
                period = min((ttl for _, ttl in self._keepalive.values()), default=1.0) / 3
            # a refresh holds _ka_put_lock, which delete, release and clear_subtree wait for:
            # it must not retry an unanswering backend for the whole outage timeout
            self._budget.seconds = period
            lost, failed = [], False
            if not items:  # (nothing held: nothing can be late)
                self._ka_alive = time.monotonic()
            for key, (value, ttl) in items:
                with self._ka_put_lock:
                    with self._ka_lock:
                        if self._keepalive.get(key) != (value, ttl):
                            continue  # deleted (or added anew) since the snapshot
                    try:
                        self.ops["write"] += 1
                        now = time.monotonic()
                        # this thread did not run for a TTL: the process stood still (stopped,
                        # frozen) and may have been replaced; not so when its refreshes failed
                        # (an outage: they are tried every period all the same)
                        if now - self._ka_alive >= ttl:
                            self._stood_still.add(key)
                        in_time = now - self._refreshed.get(key, 0.0) < ttl
                        before = self._refresh(key, value, ttl)
                        if key in self._stood_still and self._taken(key, value, before):
                            self._let_go(key, (value, ttl), before)
                            continue
                        if before is None and in_time:
                            lost.append(key)
                        self._refreshed[key] = time.monotonic()
                    except Exception as e:  # (a backend error must not end the refresher)
                        self._refresh_failed(key, e)
                        failed = True
                    finally:
                        self._ka_alive = time.monotonic()
            if not failed:
                self._ka_failing = ""
            if lost:
                self._lost(lost)
            self._ka_stop.wait(max(period, 0.02))

    def _let_go(self, key: str, held: tuple[str, float], theirs: str) -> None:
        """This process stood still past ``key``'s TTL, and another one holds it now (its
        replacement): give it back and stop refreshing it (each refresh wrote over the
        replacement's heartbeat, hiding its death, until this process was stopped). A process
        that never stood still is never replaced: it writes its own back over such a one's
        (the two may meet between that one's read and write; only the stale one lets go)."""
        try:
            self._give_back(key, held[0], theirs, held[1])
        except Exception as e:  # noqa: BLE001 - theirs comes back with its owner's refresh
            log.warning("name resolution: giving %s back failed: %s", key, first_line(e))
        with self._ka_lock:
            if self._keepalive.get(key) == held:
                del self._keepalive[key]
            self._refreshed.pop(key, None)
            self._stood_still.discard(key)
        log.warning("name resolution: %s is another process's now (this one's replacement?): "
                    "no longer refreshed by this process", key)

    def _refresh_failed(self, key: str, e: Exception) -> None:
        """A keep-alive refresh failed: said once for each cause until one succeeds (it was
        silent: a heartbeat refused for good just stopped)."""
        if type(e).__name__ != self._ka_failing:  # (by kind: an outage's text counts seconds)
            self._ka_failing = type(e).__name__
            log.warning("name resolution: refreshing %s failed (%s: %s); said once until a "
                        "refresh succeeds", key, type(e).__name__, first_line(e))

    def _lost(self, keys: list[str]) -> None:
        """Keep-alive entries were gone before a refresh that came in time (within their
        TTL of the last one): the backend lost entries (a FLUSHALL, an eviction, a stray
        delete, a deleted directory). Add back the others this process holds, where missing,
        as after a server restart. A process that stood still past the TTL (stopped, then
        continued: the controller may have replaced it meanwhile) adds nothing back (the
        refresh itself writes its keep-alive entry again, as before), nor does one that is
        stopping."""
        if self._stopping:
            return
        self.outage_seen = time.monotonic()  # others' heartbeats may be gone for a while too
        try:
            n = self._restore_owned()
        except Exception as e:  # noqa: BLE001 - the next loss found tries again
            log.warning("name resolution lost entries of this process (%s was gone): adding "
                        "them back failed: %s", keys[0], e)
            return
        log.warning("name resolution lost entries of this process (%s was gone before its "
                    "refresh): %d added back", keys[0], n)
