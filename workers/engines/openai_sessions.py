"""What the OpenAI endpoint records of each agent session, for training on it.

A request made under ``/sessions/<id>/v1/...`` belongs to session ``<id>``: every choice it
returns is recorded as a :class:`~workers.schema.SessionTurn` (the prompt's token ids, the
completion's token ids, each token's log-probability and weight version, the finish reason).
The rollout worker that owns the session fetches its turns and drops them in one call
(:meth:`SessionStore.take`, the generation server's ``take_sessions`` RPC).

Bounded, because the endpoint faces every client that holds the trial's API key:

- a request is admitted only while it fits: its choices are reserved at the start, each
  ``prompt + max_tokens`` tokens, against the session's caps (``max_turns`` choices,
  ``max_session_tokens``) and the store's (``max_sessions``, ``max_total_tokens``); what a choice
  did not use is given back when it is recorded;
- a session untouched for ``ttl`` seconds is dropped (its agent or rollout worker is gone);
- a session that was taken is closed: a choice that finishes after it (an agent that left a
  request running) is not recorded, and its id starts no new session.

A request that does not fit is refused before anything is generated (:class:`SessionRefused`:
the session's own caps -> 400, the store full -> 429), so no generated token goes unrecorded.
"""
from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
from typing import Callable

import numpy as np

from system.errors import ConfigError
from workers.schema import SessionRecord, SessionTurn

SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""What a session id may look like (it travels in a URL path)."""
CLOSED_KEPT = 4096
"""Ids of taken sessions remembered (so a late choice cannot reopen them)."""


@dataclasses.dataclass(frozen=True)
class SessionLimits:
    """Bounds of the recorded sessions (``generation.session_*`` keys)."""

    max_sessions: int = 1024
    """Sessions recorded at once."""
    max_turns: int = 64
    """Choices recorded per session."""
    max_session_tokens: int = 65536
    """Tokens (prompt + completion, summed over its choices) recorded per session."""
    max_total_tokens: int = 1 << 23
    """Tokens recorded over all sessions (about 12 bytes each)."""
    ttl: float = 600.0
    """Seconds a session may go untouched before it is dropped."""

    def __post_init__(self) -> None:
        for key in ("max_sessions", "max_turns", "max_session_tokens", "max_total_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.ttl <= 0:
            raise ConfigError(f"ttl must be > 0, got {self.ttl}")


class SessionRefused(Exception):
    """A request that does not fit the bounds; ``status`` is the HTTP code to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(eq=False)
class _Session:
    turns: list[tuple[int, int, SessionTurn]] = dataclasses.field(default_factory=list)
    """``(request seq, choice index, turn)``."""
    reserved: int = 0
    """Choices admitted and not yet recorded or released."""
    tokens: int = 0
    """Tokens recorded plus tokens reserved."""
    touched: float = 0.0


class SessionStore:
    """Every recorded session of one endpoint (thread-safe: handler threads record, the RPC
    thread takes)."""

    def __init__(self, limits: SessionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits or SessionLimits()
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._closed: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tokens = 0
        self._seq = 0
        self.stats = {"recorded": 0, "refused": 0, "expired": 0, "late": 0, "taken": 0}

    def admit(self, session: str, prompt_len: int, n: int, max_tokens: int) -> "Reservation":
        """Reserve ``n`` choices of ``prompt_len + max_tokens`` tokens for a request of
        ``session``, or raise :class:`SessionRefused`."""
        if not SESSION_ID.fullmatch(session):
            raise SessionRefused(400, "a session id is 1 to 64 characters of A-Z a-z 0-9 _ . -")
        cost = n * (prompt_len + max_tokens)
        lim = self.limits
        with self._lock:
            self._expire()
            if session in self._closed:
                self.stats["refused"] += 1
                raise SessionRefused(400, f"session {session!r} was taken (closed)")
            s = self._sessions.get(session)
            if s is None and len(self._sessions) >= lim.max_sessions:
                self._refuse(429, f"{lim.max_sessions} sessions are recorded already")
            held = (len(s.turns) + s.reserved, s.tokens) if s else (0, 0)
            if held[0] + n > lim.max_turns:
                self._refuse(400, f"session {session!r} would exceed {lim.max_turns} "
                                  "recorded choices (generation.session_max_turns)")
            if held[1] + cost > lim.max_session_tokens:
                self._refuse(400, f"session {session!r} would exceed {lim.max_session_tokens} "
                                  "recorded tokens (generation.session_max_tokens)")
            if self._tokens + cost > lim.max_total_tokens:
                self._refuse(429, "the recorded sessions hold too many tokens; try again later")
            if s is None:
                s = self._sessions[session] = _Session()
            s.reserved += n
            s.tokens += cost
            s.touched = self._clock()
            self._tokens += cost
            self._seq += 1
            return Reservation(self, session, s, self._seq, n, prompt_len + max_tokens)

    def _refuse(self, status: int, message: str) -> None:
        self.stats["refused"] += 1
        raise SessionRefused(status, message)

    def _expire(self) -> None:
        """Drop sessions untouched for ``ttl`` (the lock is held)."""
        old = self._clock() - self.limits.ttl
        for sid in [k for k, s in self._sessions.items() if s.touched < old]:
            self._tokens -= self._sessions.pop(sid).tokens
            self.stats["expired"] += 1

    def _settle(self, sid: str, s: _Session, each: int, turn: SessionTurn | None, seq: int,
                index: int) -> None:
        """One reserved choice is over: record ``turn`` (None: nothing to record) and give
        back what it reserved beyond what it holds."""
        with self._lock:
            s.reserved -= 1
            used = len(turn["prompt"]) + len(turn["tokens"]) if turn is not None else 0
            back = each - used
            if self._sessions.get(sid) is not s:  # taken or expired meanwhile
                if turn is not None:
                    self.stats["late"] += 1
                return
            s.tokens -= back
            self._tokens -= back
            s.touched = self._clock()
            if turn is not None:
                s.turns.append((seq, index, turn))
                self.stats["recorded"] += 1

    def take(self, sessions: list[str]) -> list[SessionRecord]:
        """Each session's turns, in the order its requests were made (then by choice), and
        drop them; an unknown (or expired) session comes back with ``found`` False."""
        out: list[SessionRecord] = []
        with self._lock:
            self._expire()
            for sid in sessions:
                s = self._sessions.pop(sid, None)
                if s is not None:
                    self._tokens -= s.tokens
                    self.stats["taken"] += 1
                if SESSION_ID.fullmatch(sid):
                    self._closed[sid] = None
                    while len(self._closed) > CLOSED_KEPT:
                        self._closed.popitem(last=False)
                turns = [t for _, _, t in sorted(s.turns, key=lambda x: x[:2])] if s else []
                out.append({"session": sid, "found": s is not None, "turns": turns,
                            "pending": s.reserved if s else 0})
        return out

    def held(self) -> tuple[int, int]:
        """(sessions, tokens) held now, reservations included."""
        with self._lock:
            return len(self._sessions), self._tokens


class Reservation:
    """The choices one admitted request may record."""

    def __init__(self, store: SessionStore, sid: str, session: _Session, seq: int, n: int,
                 each: int) -> None:
        self._store, self.sid, self._s, self._seq, self._each = store, sid, session, seq, each
        self._open = set(range(n))

    def record(self, index: int, prompt: list[int], tokens: list[int], logprobs: list[float],
               versions: list[int], finish: str, temperature: float) -> None:
        """Choice ``index`` finished: record it (``temperature``: the one its log-probs are
        at)."""
        if index not in self._open:
            return
        self._open.discard(index)
        turn: SessionTurn = {"prompt": np.asarray(prompt, np.int32),
                             "tokens": np.asarray(tokens, np.int32),
                             "logprobs": np.asarray(logprobs, np.float32),
                             "versions": np.asarray(versions, np.int32), "finish": finish,
                             "temperature": float(temperature)}
        self._store._settle(self.sid, self._s, self._each, turn, self._seq, index)

    def release(self) -> None:
        """The request is over: choices that never finished record nothing."""
        for index in sorted(self._open):
            self._store._settle(self.sid, self._s, self._each, None, self._seq, index)
        self._open.clear()
