"""The master's bookkeeping for rollouts: prompt order, routing and task hand-out.

- :class:`PromptCursor`: each epoch visits every training prompt once in a seeded order; prompts
  whose rollouts were lost (a failed rollout, a stale group dropped, a crash before training)
  are handed out again first, so within an epoch no prompt is skipped or trained on twice.
- :class:`Router`: least outstanding requests across generation servers; all samples of one
  prompt go to one server.
- :class:`TaskSource`: what the master's ``next_task`` RPC serves, gated by admission.
"""
from __future__ import annotations

import random
import threading
from typing import Any

from experiments.rl.admission import AdmissionController, Ticket
from workers.schema import Task, TaskReply


class PromptCursor:
    def __init__(self, ids: list[int], seed: int) -> None:
        if not ids:
            raise ValueError("no training prompts")
        self.ids = list(ids)
        self.seed = seed
        self.epoch = 0
        self.pos = 0
        self.redo: list[tuple[int, int]] = []  # (prompt id, epoch) to hand out again first
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> list[int]:
        order = list(self.ids)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> tuple[int, int]:
        """``(prompt id, epoch)``."""
        if self.redo:
            pid, epoch = self.redo.pop(0)
            return pid, epoch
        if self.pos >= len(self._order):
            self.epoch += 1
            self.pos = 0
            self._order = self._perm(self.epoch)
        pid = self._order[self.pos]
        self.pos += 1
        return pid, self.epoch

    def give_back(self, pid: int, epoch: int) -> None:
        """A prompt whose rollout was lost: hand it out again next (in its own epoch)."""
        self.redo.append((pid, epoch))

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "redo": [list(r) for r in self.redo]}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.redo = [(int(p), int(e)) for p, e in state["redo"]]
        self._order = self._perm(self.epoch)


class Router:
    """Least outstanding requests (ties: the lowest index)."""

    def __init__(self, servers: int) -> None:
        self.outstanding = [0] * servers
        self._lock = threading.Lock()

    def pick(self, weight: int = 1) -> int:
        with self._lock:
            i = min(range(len(self.outstanding)), key=lambda k: (self.outstanding[k], k))
            self.outstanding[i] += weight
            return i

    def done(self, server: int, weight: int = 1) -> None:
        with self._lock:
            self.outstanding[server] = max(0, self.outstanding[server] - weight)


class TaskSource:
    """Hands out ``(ticket, prompt, server)`` while admission allows; remembers what is in
    flight so that lost work goes back to the cursor."""

    def __init__(self, admission: AdmissionController, cursor: PromptCursor, router: Router,
                 group_size: int) -> None:
        self.admission, self.cursor, self.router = admission, cursor, router
        self.group_size = group_size
        self.in_flight: dict[int, Task] = {}
        self.done = False
        self._lock = threading.Lock()

    def next_task(self, worker: int, max_tasks: int) -> TaskReply:
        tasks: list[Task] = []
        with self._lock:
            if self.done:
                return {"done": True}
            for _ in range(max_tasks):
                ticket = self.admission.try_admit()
                if ticket is None:
                    break
                pid, epoch = self.cursor.next()
                task: Task = {"seq": ticket.seq, "version": ticket.version, "prompt_id": pid,
                              "epoch": epoch, "server": self.router.pick(self.group_size),
                              "worker": worker}
                self.in_flight[ticket.seq] = task
                tasks.append(task)
        return {"tasks": tasks} if tasks else {"wait": 0.05}

    def finish(self, seq: int, accepted: bool) -> Task | None:
        """A group came back (or failed). Returns its task, or None for an unknown seq (a
        duplicate, or from before a restart)."""
        with self._lock:
            task = self.in_flight.pop(seq, None)
            if task is None:
                return None
            self.router.done(task["server"], self.group_size)
            self.admission.finish(Ticket(seq, task["version"]), accepted)
            if not accepted:
                self.cursor.give_back(task["prompt_id"], task["epoch"])
            return task

    def give_back(self, prompts: list[tuple[int, int]]) -> None:
        """``(prompt id, epoch)`` of groups dropped before training."""
        with self._lock:
            for pid, epoch in prompts:
                self.cursor.give_back(pid, epoch)

    def stop(self) -> None:
        with self._lock:
            self.done = True

    def snapshot(self) -> dict[str, Any]:
        """Cursor state with the in-flight prompts put back first (their results are not in
        the checkpoint)."""
        with self._lock:
            st = self.cursor.state()
            st["redo"] = [[t["prompt_id"], t["epoch"]] for t in sorted(
                self.in_flight.values(), key=lambda t: t["seq"])] + st["redo"]
            return st
