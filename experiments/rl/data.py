"""The master's bookkeeping for rollouts: prompt order, routing and task hand-out.

- :class:`PromptCursor`: each epoch visits every training prompt once in a seeded order; prompts
  whose rollouts were lost (a failed rollout, a stale group dropped, a crash before training)
  are handed out again first, so within an epoch no prompt is skipped or trained on twice.
- :class:`Router`: least outstanding requests across the live generation servers; all samples
  of one prompt go to one server; while none is live, no task is handed out.
- :class:`TaskSource`: what the master's ``next_task`` RPC serves, gated by admission. Every task
  handed out carries a lease (``lease_timeout`` seconds on the master's clock): an expired lease,
  or any lease of a rollout worker known to be dead, is released as if its rollout had failed
  (admission slot and router load freed, prompt handed out again in its own epoch), and a group
  that arrives for it afterwards is unknown and dropped, so no prompt is trained twice.
"""
from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from typing import Any, Callable

from experiments.rl.admission import AdmissionController, Ticket
from system.errors import ConfigError
from workers.schema import Task, TaskReply


class PromptCursor:
    def __init__(self, ids: list[int], seed: int) -> None:
        if not ids:
            raise ValueError("PromptCursor: no training prompts (tasks.dataset refuses an "
                             "empty training set, naming its file or task)")
        self.ids = list(ids)
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self.redo: list[tuple[int, int]] = []  # (prompt id, epoch) to hand out again first
        self.skipped: set[int] = set()  # prompts never handed out again (see ``skip``)
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        order = list(self.ids)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> tuple[int, int]:
        """``(prompt id, epoch)``, never a skipped one (ValueError once every one is)."""
        if self.redo:
            pid, epoch = self.redo.pop(0)
            return pid, epoch
        if self.exhausted:
            raise ValueError("every prompt is skipped")
        while True:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._perm(self.epoch)
            pid = self._order[self.pos]
            self.pos += 1
            if pid not in self.skipped:
                return pid, self.epoch

    @property
    def exhausted(self) -> bool:
        """Every prompt is skipped (and none is left to redo)."""
        return not self.redo and len(self.skipped) >= len(self.ids)

    def skip(self, pid: int) -> None:
        """Never hand ``pid`` out again (its request can never be served). The epochs' orders
        stay as they are: the others keep their places, so a resume lands where it did."""
        self.skipped.add(pid)
        self.redo = [r for r in self.redo if r[0] != pid]

    def give_back(self, pid: int, epoch: int) -> None:
        """A prompt whose rollout was lost: hand it out again next (in its own epoch)."""
        self.redo.append((pid, epoch))

    @property
    def digest(self) -> str:
        """A fingerprint of the prompt ids in their order (what the epochs' orders draw from)."""
        return hashlib.sha256(json.dumps(self.ids).encode()).hexdigest()[:12]

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "redo": [list(r) for r in self.redo],
                "seed": self.seed, "prompts": len(self.ids), "digest": self.digest}

    def restore(self, state: dict[str, Any], checkpoint: str = "the checkpoint") -> None:
        """Continue where ``state`` (of ``checkpoint``) left off. Its epochs' orders hold only
        for the same prompts in the same seeded order: another training set or ``rl.seed``
        is a :class:`ConfigError` (its position would hand out prompts twice, skip others,
        or name ids the rollout workers do not have). A state without the fingerprint (an
        older checkpoint) is taken as it is."""
        way_out = ("; or train a new trial from its weights: rl.model_path="
                   f"{checkpoint}/actor")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ConfigError(f"rl.seed={self.seed}: {checkpoint} drew its prompt order with "
                              f"rl.seed={state['seed']}, which a continued trial keeps. Launch "
                              f"it with rl.seed={state['seed']}{way_out}")
        if "digest" in state and state["digest"] != self.digest:
            raise ConfigError(
                f"{checkpoint} was trained on {state['prompts']} prompts (ids {state['digest']})"
                f", this run's training set has {len(self.ids)} (ids {self.digest}): a "
                "continued trial needs the prompts it trained on (its rl.task.name, "
                "train_path, train_size and fields) to keep each epoch free of repeats and "
                f"gaps. Launch it with those{way_out}")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.redo = [(int(p), int(e)) for p, e in state["redo"]]
        self._order = self._perm(self.epoch)


class Router:
    """Least outstanding requests among the live servers (ties: the lowest index)."""

    def __init__(self, servers: int) -> None:
        self.outstanding = [0] * servers
        self.live = set(range(servers))
        """Servers that take requests (a dead one is left out until it rejoins)."""
        self._lock = threading.Lock()

    def set_live(self, live: set[int]) -> None:
        with self._lock:
            self.live = set(live)

    def available(self) -> bool:
        with self._lock:
            return bool(self.live)

    def pick(self, weight: int = 1) -> int:
        """The live server with the fewest outstanding requests (raises when none is live:
        callers check :meth:`available` first)."""
        i = self.try_pick(weight)
        if i is None:
            raise RuntimeError("no generation server is live")
        return i

    def try_pick(self, weight: int = 1) -> int | None:
        """:meth:`pick`, or None when no server is live (one may have died since a look at
        :meth:`available`: the caller then hands out nothing)."""
        with self._lock:
            if not self.live:
                return None
            i = min(self.live, key=lambda k: (self.outstanding[k], k))
            self.outstanding[i] += weight
            return i

    def done(self, server: int, weight: int = 1) -> None:
        with self._lock:
            self.outstanding[server] = max(0, self.outstanding[server] - weight)


class TaskSource:
    """Hands out ``(ticket, prompt, server)`` while admission allows; remembers what is in
    flight, each task under a lease, so that lost work goes back to the cursor."""

    def __init__(self, admission: AdmissionController, cursor: PromptCursor, router: Router,
                 group_size: int, lease_timeout: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if lease_timeout <= 0:
            raise ValueError(f"lease_timeout must be > 0, got {lease_timeout}")
        self.admission, self.cursor, self.router = admission, cursor, router
        self.group_size = group_size
        self.lease_timeout, self.clock = lease_timeout, clock
        self.in_flight: dict[int, Task] = {}
        self.deadlines: dict[int, float] = {}  # seq -> when its lease expires (``clock`` time)
        self.expired = 0   # leases that ran out (cumulative, for the metrics)
        self.released = 0  # leases of rollout workers found dead (cumulative)
        self.incarnations: dict[int, str] = {}  # rollout worker -> the process last seen asking
        self.done = False
        self._lock = threading.Lock()

    def next_task(self, worker: int, max_tasks: int, incarnation: str = "") -> TaskReply:
        """Up to ``max_tasks`` tasks for rollout worker ``worker``. A worker asking under a new
        ``incarnation`` was restarted: the leases its predecessor held are released first (its
        results will never come)."""
        tasks: list[Task] = []
        with self._lock:
            if self.done:
                return {"done": True}
            if incarnation and self.incarnations.get(worker, incarnation) != incarnation:
                self.released += len(self._release(worker))
            if incarnation:
                self.incarnations[worker] = incarnation
            deadline = self.clock() + self.lease_timeout
            for _ in range(max_tasks):
                if self.cursor.exhausted:  # (the loop stops the trial)
                    break
                # the server first: the last live one may die meanwhile (a prompt and an
                # admission slot taken before would be lost, the slot for good)
                server = self.router.try_pick(self.group_size)
                if server is None:
                    break
                ticket = self.admission.try_admit()
                if ticket is None:
                    self.router.done(server, self.group_size)
                    break
                pid, epoch = self.cursor.next()
                task: Task = {"seq": ticket.seq, "version": ticket.version, "prompt_id": pid,
                              "epoch": epoch, "server": server, "worker": worker}
                self.in_flight[ticket.seq] = task
                self.deadlines[ticket.seq] = deadline
                tasks.append(task)
        return {"tasks": tasks} if tasks else {"wait": 0.05}

    def leased(self, seq: int) -> bool:
        """Whether ``seq`` is a task out on lease (not a duplicate, a leftover from before a
        restart, or one whose lease was already released)."""
        with self._lock:
            return seq in self.in_flight

    def finish(self, seq: int, accepted: bool, redo: bool = True) -> Task | None:
        """A group came back (or failed). Returns its task, or None for an unknown seq (a
        duplicate, from before a restart, or one whose lease was already released). A group
        not accepted is done again, unless ``redo`` is false (it was filtered out: its prompt
        was used, as an accepted one's, and comes in the next epoch)."""
        with self._lock:
            return self._end(seq, accepted, redo)

    def _end(self, seq: int, accepted: bool, redo: bool = True) -> Task | None:
        """End ``seq``'s lease (the lock is held): free its router load and admission slot; a
        rejected one's prompt goes back to the cursor in its own epoch (if ``redo``)."""
        task = self.in_flight.pop(seq, None)
        if task is None:
            return None
        del self.deadlines[seq]
        self.router.done(task["server"], self.group_size)
        self.admission.finish(Ticket(seq, task["version"]), accepted)
        if not accepted and redo:
            self.cursor.give_back(task["prompt_id"], task["epoch"])
        return task

    def skip(self, seq: int) -> Task | None:
        """``seq``'s group failed for good: end its lease as failed and skip its prompt (it is
        not handed out again). None for an unknown seq (see :meth:`finish`)."""
        with self._lock:
            task = self._end(seq, accepted=False)
            if task is not None:
                self.cursor.skip(task["prompt_id"])
            return task

    def expire(self, now: float | None = None) -> list[Task]:
        """Release every lease whose deadline has passed (``now``: default ``clock()``), as
        failed rollouts; returns their tasks, oldest first."""
        with self._lock:
            now = self.clock() if now is None else now
            seqs = sorted(s for s, d in self.deadlines.items() if d <= now)
            out = [t for t in (self._end(s, accepted=False) for s in seqs) if t is not None]
            self.expired += len(out)
            return out

    def release_worker(self, worker: int) -> list[Task]:
        """Release at once every lease held by rollout worker ``worker`` (known dead), so its
        prompts go to the others; returns their tasks, oldest first."""
        with self._lock:
            out = self._release(worker)
            self.released += len(out)
            return out

    def _release(self, worker: int) -> list[Task]:
        """End every lease ``worker`` holds, as failed (the lock is held)."""
        seqs = sorted(s for s, t in self.in_flight.items() if t["worker"] == worker)
        return [t for t in (self._end(s, accepted=False) for s in seqs) if t is not None]

    def lease_holders(self) -> set[int]:
        """Rollout workers holding at least one lease."""
        with self._lock:
            return {t["worker"] for t in self.in_flight.values()}

    def give_back(self, prompts: list[tuple[int, int]]) -> None:
        """``(prompt id, epoch)`` of groups dropped before training."""
        with self._lock:
            for pid, epoch in prompts:
                self.cursor.give_back(pid, epoch)

    def stop(self) -> None:
        with self._lock:
            self.done = True

    def resume_seq(self) -> int:
        """The sequence number a run resumed from a checkpoint taken now goes on from: the
        first in-flight task's when the tasks in flight are the last ones handed out (a sync
        run between steps: resumed, it hands out the same prompts, put back first, under the
        same numbers, so with the same sampling seeds), else the next one's."""
        with self._lock:
            issued = self.admission.issued
            seqs = sorted(self.in_flight)
            return seqs[0] if seqs and seqs == list(range(seqs[0], issued)) else issued

    def snapshot(self) -> dict[str, Any]:
        """Cursor state with the in-flight prompts put back first (their results are not in
        the checkpoint)."""
        with self._lock:
            st = self.cursor.state()
            st["redo"] = [[t["prompt_id"], t["epoch"]] for t in sorted(
                self.in_flight.values(), key=lambda t: t["seq"])] + st["redo"]
            return st


def describe_tasks(tasks: list[Task], most: int = 8) -> str:
    """``seq 5 (prompt 12, epoch 0, worker 1), ...`` for a warning (the first ``most``)."""
    text = ", ".join(f"seq {t['seq']} (prompt {t['prompt_id']}, epoch {t['epoch']}, worker "
                     f"{t['worker']})" for t in tasks[:most])
    return text + (f" and {len(tasks) - most} more" if len(tasks) > most else "")
