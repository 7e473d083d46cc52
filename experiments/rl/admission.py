"""Bounded-staleness admission of rollouts (asynchronous RL), as in AReaL.

Two halves:

- Admission (:class:`AdmissionController`): the trainer consumes ``batch_size`` (B) trajectories
  per step and then publishes weight version ``v + 1``. A rollout may start only while
  ``accepted + running < (v + eta + 1) * B``, where ``accepted`` counts every trajectory accepted
  so far (consumed or buffered) and ``running`` those in flight. So in flight plus buffered never
  exceeds ``(1 + eta) * B``, and trajectories consumed in admission order are at most ``eta``
  versions old. Rejected (filtered) rollouts give their slot back, and so do rollouts whose
  lease ran out or whose rollout worker died (``TaskSource.expire`` / ``release_worker`` finish
  them as rejected): a lost rollout can never hold a slot for good, so even with ``eta = 0``
  (where the whole batch must be admitted before any of it trains) one leaked task cannot stall
  the loop, and the bound above is unchanged. After a resume with another ``B``, the steps
  before the restored version count as that many steps of the new ``B`` (see
  :meth:`AdmissionController.restore`), so the bound is the same as for a fresh run.
- Consumption (:class:`TrajectoryBuffer`): rollouts finish out of order, so one admitted early
  and finished late could still be too old. The buffer serves the oldest admissible
  trajectories first and drops (and counts) any whose weights lag more than ``eta`` versions;
  their slots go back to admission. No trained trajectory is more than ``eta`` versions old.
"""
from __future__ import annotations

import dataclasses
import threading

from system.errors import ConfigError


@dataclasses.dataclass
class AdmissionConfig:
    """Asynchronous rollout admission."""

    batch_size: int = 32
    """Trajectories per training step (B)."""
    max_head_offpolicyness: int = 1
    """eta: the largest number of versions a trained trajectory's weights may lag behind."""
    max_concurrent: int = 0
    """At most this many rollouts in flight (0: only the staleness bound limits)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_head_offpolicyness < 0:
            raise ConfigError(f"max_head_offpolicyness must be >= 0, got "
                              f"{self.max_head_offpolicyness}")
        if self.max_concurrent < 0:
            raise ConfigError(f"max_concurrent must be >= 0, got {self.max_concurrent}")


@dataclasses.dataclass(frozen=True)
class Ticket:
    """Permission for one rollout, stamped with the weight version current at admission."""

    seq: int
    version: int


class AdmissionController:
    """Thread-safe admission gate kept by the master."""

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._version = 0
        self._accepted = 0
        self._running = 0
        self._issued = 0
        self._consumed = 0
        # accepted trajectories that the staleness bound does not count: after a restore, those
        # consumed beyond ``version * batch_size`` (earlier steps ran with another batch size)
        self._uncounted = 0

    @property
    def version(self) -> int:
        return self._version

    def _capacity(self) -> int:
        eta, b = self.cfg.max_head_offpolicyness, self.cfg.batch_size
        cap = (self._version + eta + 1) * b - (self._accepted - self._uncounted + self._running)
        if self.cfg.max_concurrent:
            cap = min(cap, self.cfg.max_concurrent - self._running)
        return max(0, cap)

    def try_admit(self) -> Ticket | None:
        with self._lock:
            if self._capacity() <= 0:
                return None
            self._running += 1
            self._issued += 1
            return Ticket(self._issued - 1, self._version)

    def finish(self, ticket: Ticket, accepted: bool) -> None:
        """A rollout ended: accepted into the buffer, or rejected (its slot is given back)."""
        with self._lock:
            if self._running <= 0:
                raise RuntimeError(f"finish({ticket}) without a running rollout")
            self._running -= 1
            self._accepted += int(accepted)

    def consumed(self, n: int) -> None:
        """The trainer took ``n`` accepted trajectories from the buffer."""
        with self._lock:
            if self._consumed + n > self._accepted:
                raise RuntimeError("consumed more trajectories than were accepted")
            self._consumed += n

    def discard(self, n: int) -> None:
        """``n`` accepted trajectories were dropped as too stale: their slots come back."""
        with self._lock:
            if self._accepted - n < self._consumed:
                raise RuntimeError("discarded more trajectories than are buffered")
            self._accepted -= n

    def set_version(self, version: int) -> None:
        """The trainer published new weights."""
        with self._lock:
            if version < self._version:
                raise RuntimeError(f"version went back from {self._version} to {version}")
            self._version = version

    @property
    def issued(self) -> int:
        """Tickets handed out: the next one's sequence number."""
        with self._lock:
            return self._issued

    def restore(self, version: int, consumed: int, buffered: int, issued: int = 0) -> None:
        """Resume: ``consumed`` trajectories trained so far, ``buffered`` restored into the
        buffer, nothing in flight, ``issued`` tickets handed out before (their sequence numbers
        are not given again).

        ``consumed`` is kept as it is (the dataset position), but the steps before ``version``
        may have run with another batch size, so the bound counts them as ``version`` steps of
        the current one: admission may run ``(1 + eta) * B - buffered`` ahead, as if the whole
        run had used this B (with an unchanged B, ``consumed == version * B`` and nothing
        changes)."""
        with self._lock:
            self._version, self._consumed = version, consumed
            self._accepted, self._running = consumed + buffered, 0
            self._uncounted = consumed - version * self.cfg.batch_size
            self._issued = max(issued, 0)

    def outstanding(self) -> int:
        """In flight plus buffered (accepted, not yet consumed)."""
        with self._lock:
            return self._running + self._accepted - self._consumed


class TrajectoryBuffer:
    """Accepted trajectories waiting for training, each with the weight version that produced
    it (for a partial rollout: its oldest segment's). Not thread-safe: the master's loop owns it."""

    def __init__(self, max_head_offpolicyness: int) -> None:
        self.eta = max_head_offpolicyness
        self._items: list[tuple[int, int, object]] = []  # (version, order, item)
        self._arrivals = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: object, version: int, order: int | None = None) -> None:
        """Buffer ``item``, produced by weight version ``version``. Within one version, items
        are taken by ``order`` (the task's sequence number: a batch then does not depend on
        which rollout finished first; None: by arrival)."""
        self._items.append((version, self._arrivals if order is None else order, item))
        self._arrivals += 1

    def drop_stale(self, current_version: int) -> list[object]:
        """Remove what is more than ``eta`` versions behind ``current_version`` and return it
        (the caller gives the slots back to admission and redoes the prompts)."""
        stale = [e[2] for e in self._items if current_version - e[0] > self.eta]
        self._items = [e for e in self._items if current_version - e[0] <= self.eta]
        self.dropped += len(stale)
        return stale

    def items(self) -> list[tuple[object, int]]:
        """Everything buffered, with versions (for checkpoints)."""
        return [(item, v) for v, _, item in self._items]

    def take(self, n: int, current_version: int) -> list[tuple[object, int]] | None:
        """``n`` trajectories (with their versions), oldest version first (then by order),
        once ``n`` admissible ones are buffered; else ``None``. Call :meth:`drop_stale`
        first."""
        if any(current_version - v > self.eta for v, _, _ in self._items):
            raise RuntimeError("stale trajectories in the buffer: call drop_stale first")
        if len(self._items) < n:
            return None
        self._items.sort(key=lambda e: (e[0], e[1]))
        batch, self._items = self._items[:n], self._items[n:]
        return [(item, v) for v, _, item in batch]
