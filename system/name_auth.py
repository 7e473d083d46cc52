"""Authenticated name-resolution values.

A trial's entries are stored as ``v1:<mac>:<value>``, ``mac`` being HMAC-SHA256 (hex) over the
key and the value under a key derived from the trial's secret. An entry whose mac does not check
(written by someone without the secret, altered, or copied from another key or another run of
the trial, whose secret differs) reads as absent; each such entry is counted and logged once.

Every key is written after the launcher created the trial's secret and read by processes that
hold it (the launcher and controller, every worker), so no key needs to be readable without it.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading

log = logging.getLogger("name_resolve")

VERSION = "v1"
_MAC_HEX = 64
_LOGGED_MAX = 1000  # refused keys remembered for "logged once"; a flood does not grow memory


class EntrySealer:
    """Seals values before they are stored and opens what is read back. ``secret=None`` stores
    values as they are (tools that run outside a trial, in a private directory of their own)."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = (None if secret is None else
                     hmac.new(secret, b"rlsys name-resolve " + VERSION.encode(),
                              hashlib.sha256).digest())
        self.refused = 0
        """Entries refused so far (forged, altered, or sealed with another secret)."""
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def _mac(self, key: str, value: str) -> str:
        assert self._key is not None
        k = key.encode()
        msg = len(k).to_bytes(4, "big") + k + value.encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def seal(self, key: str, value: str) -> str:
        """What is stored under ``key`` for ``value``."""
        if self._key is None:
            return value
        return f"{VERSION}:{self._mac(key, value)}:{value}"

    def open(self, key: str, stored: str | None) -> str | None:
        """The value of an authentic entry; None for an absent or refused one."""
        if stored is None or self._key is None:
            return stored
        if self.authentic(key, stored):
            return stored[4 + _MAC_HEX:]
        self._refuse(key)
        return None

    def authentic(self, key: str, stored: str) -> bool:
        """Whether ``stored`` under ``key`` was sealed with this secret (nothing counted)."""
        if self._key is None:
            return True
        parts = _sealed(stored)
        return parts is not None and hmac.compare_digest(
            parts[0].encode(), self._mac(key, parts[1]).encode())

    def _refuse(self, key: str) -> None:
        with self._lock:
            self.refused += 1
            first = key not in self._logged and len(self._logged) < _LOGGED_MAX
            if first:
                self._logged.add(key)
        if first:
            log.warning("name-resolution entry %r failed authentication (not written with this "
                        "trial's secret: forged, altered, or left by an earlier run): treated "
                        "as absent", key)


def _sealed(stored: str) -> tuple[str, str] | None:
    """``(mac, value)`` of a stored ``v1:<mac>:<value>`` entry; None if it is not one."""
    if stored.startswith(VERSION + ":") and stored[3 + _MAC_HEX:4 + _MAC_HEX] == ":":
        return stored[3:3 + _MAC_HEX], stored[4 + _MAC_HEX:]
    return None


def unverified_value(stored: str) -> str:
    """The value part of a sealed entry, its mac NOT checked: for a message about an entry
    that is not this trial's (another trial's of the same name), never to act on."""
    parts = _sealed(stored)
    return stored if parts is None else parts[1]
