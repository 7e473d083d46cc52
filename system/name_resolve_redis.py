"""The ``redis`` name-resolution backend: a real Redis server (``SET NX PX``, native TTLs, SCAN
not KEYS); each user's keys under a prefix of their own."""
from __future__ import annotations

import os
import time
from typing import Iterator

from system.errors import NameEntryExists, NameResolveError
from system.name_resolve_api import NameResolve


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
