"""Rollout workers: take tasks from the master, run the agent against the server the master
picked, score the samples and stream each group to the master. With ``rl.agent.kind=openai``
the agent is a function written against the OpenAI API (:mod:`experiments.rl.openai_agent`):
its sessions run on the server's HTTP endpoint and come back as recorded turns."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, NamedTuple

from experiments.rl.agents import Episode, make_agent, task_seed
from experiments.rl.common import (encode_prompt, load_tokenizer, model_path, reward_watch,
                                   rl_config)
from experiments.rl.config import RLConfig
from experiments.rl.episodes import run_episodes, score, unservable
from experiments.rl.roles.master_link import MasterLink
from experiments.rl.openai_agent import OpenAIAgent, Session, group_trajectories
from experiments.rl.tasks import dataset, get_task
from system import names
from system.errors import RemoteError, RpcError, first_line
from workers.generation import GenerationClient
from workers.rollout import RolloutWorker
from workers.schema import GroupMessage, Task, Trajectory

log = logging.getLogger("rl-rollout")


class Outcome(NamedTuple):
    """One task's rollout: its scored trajectories, or why its group failed."""

    trajs: list[Trajectory]
    error: str
    refused: bool
    """A server refused the request for good (see :func:`unservable`)."""
    agent_error: bool
    """It failed in the agent function (see :mod:`experiments.rl.agent_failures`)."""


class _Rollouts:
    """One rollout worker's tasks: its agent, prompts, and clients of the master and servers."""

    def __init__(self, worker: RolloutWorker, rl: RLConfig) -> None:
        self.worker, self.rl = worker, rl
        self.tok = load_tokenizer(model_path(worker, rl))
        self.task = get_task(rl.task)
        self.watch = reward_watch(worker, rl.task.reward_timeout)
        self.prompts = {p["id"]: p for p in dataset(rl.task, "train")}
        self.agent = make_agent(rl.agent, self.tok)
        self.openai = (OpenAIAgent.for_trial(rl.agent, worker.boot.trial_dir, rl.call_timeout)
                       if rl.agent.kind == "openai" else None)
        self.encoded: dict[int, list[int]] = {}
        self.gens: dict[int, GenerationClient] = {}
        self.incarnation = uuid.uuid4().hex
        """This process, as the master knows it: a restarted worker asks under a new one."""
        self.link = MasterLink(worker, rl.startup_timeout)

    def _server_key(self, index: int) -> str:
        return names.worker_address(self.worker.exp, self.worker.trial, "generation", index)

    def server_alive(self, index: int) -> bool:
        """Whether generation server ``index`` still heart-beats and is still the process this
        worker talks to (a restarted server registers at a new address)."""
        address = self.worker.serving_at("generation", index)
        client = self.gens.get(index)
        return address is not None and client is not None and client.rpc.address == address

    def past_stop_by(self) -> bool:
        """Whether this worker, stopped by a signal, may wait for its episodes no longer
        (:attr:`~workers.base.Worker.stop_by`): they are cut short and their tasks go back to
        the master as failed groups, handed out again at once, before Slurm ends the job."""
        by = self.worker.stop_by
        return by is not None and time.monotonic() >= by

    def _failed(self, e: Exception) -> None:
        """Log a rollout that failed: with its traceback, or in one line when this worker is
        stopping (the trial's end stops the servers beside it: their calls fail meanwhile)."""
        if self.worker.stopping:
            log.info("rollout cut short by the stop (%s: %s)", type(e).__name__, first_line(e))
        else:
            log.exception("rollout failed")

    def server(self, index: int) -> GenerationClient:
        """A client of generation server ``index`` at the address it is registered at now (a
        restarted or requeued server comes back elsewhere)."""
        w = self.worker
        address = w.name_resolve.wait(self._server_key(index), 60, stop=lambda: w.stopping)
        client = self.gens.get(index)
        if client is None or client.rpc.address != address:
            if client is not None:
                client.close()
            self.gens[index] = GenerationClient(w.client(address, self.rl.call_timeout),
                                                f"generation/{index}")
        return self.gens[index]

    def run_tasks(self, tasks: list[Task]) -> list[Outcome]:
        """Each task's scored trajectories, or why its group failed."""
        if self.openai is not None:
            return self.run_openai(tasks)
        results, owner, error, refused = self.run(tasks)
        if refused and len(tasks) > 1:  # the refused request must not fail the others with it
            return [r for t in tasks for r in self.run_tasks([t])]
        out = []
        for k, t in enumerate(tasks):
            trajs = [tr for i, r in enumerate(results) if owner[i] == k for tr in r]
            if not error:
                score(trajs, self.tok, self.prompts[t["prompt_id"]]["answer"], self.task.reward,
                      watch=self.watch)
            out.append(Outcome(trajs, error, refused, False))
        return out

    def run_openai(self, tasks: list[Task]) -> list[Outcome]:
        """``group_size`` agent calls per task, all at once; then every session's recorded
        turns, fetched and dropped, as trajectories (a group that failed in the function:
        ``agent_error``)."""
        assert self.openai is not None
        groups = [[Session(t["server"], dict(self.prompts[t["prompt_id"]]))
                   for _ in range(self.rl.group_size)] for t in tasks]
        flat = [s for g in groups for s in g]
        servers = sorted({t["server"] for t in tasks})
        records, error = {}, ""
        try:
            w = self.worker
            http = {i: w.name_resolve.wait(names.http_address(w.exp, w.trial, i), 60,
                                           stop=lambda: w.stopping) for i in servers}
            for i in servers:
                self.server(i)
            self.openai.run(flat, http, self.server_alive, self.past_stop_by)
        except Exception as e:  # a server failed or was cut off: give the tasks back
            self._failed(e)
            error = f"{type(e).__name__}: {e}"
        # fetch and drop (after a failure too, from every server still serving: nothing there
        # waits for its expiry, holding the session store's room)
        unfetched: dict[int, str] = {}  # servers whose sessions could not be fetched: why
        for i in servers:
            if error and not self.server_alive(i):
                continue
            try:
                got = self.gens[i].take_sessions([s.id for s in flat if s.server == i]
                                                 ).result(self.rl.call_timeout)
                records.update({r["session"]: r for r in got})
            except (RpcError, KeyError) as e:
                log.warning("take_sessions on generation server %d failed: %s", i, e)
                unfetched[i] = f"take_sessions on generation server {i} failed: {e}"
        if error:
            self._forget(servers)
            return [Outcome([], error, False, False)] * len(tasks)
        if unfetched:
            self._forget(sorted(unfetched))
        # a group fails in the agent function only where its server is fine: a call that
        # raised because its server died (before the watch saw it) is not the function's
        gone = {i for i in servers if i not in unfetched and not self.server_alive(i)}
        out = []
        for t, g in zip(tasks, groups):
            if t["server"] in unfetched:
                out.append(Outcome([], unfetched[t["server"]], False, False))
                continue
            trajs, why = group_trajectories(g, records)
            out.append(Outcome(trajs, why, False, bool(why) and t["server"] not in gone))
        return out

    def _forget(self, servers: list[int]) -> None:
        """Look these servers up again next time: one requeued by Slurm registers anew."""
        for server in servers:
            if server in self.gens:
                self.gens.pop(server).close()

    def run(self, tasks: list[Task]) -> tuple[list[list[Trajectory]], list[int], str, bool]:
        """Every task's episodes, driven together: (results, owning task per episode, error,
        whether a server refused a request for good)."""
        episodes: list[tuple[Episode, int]] = []
        owner: list[int] = []
        for k, t in enumerate(tasks):
            self.server(t["server"])
            pid = t["prompt_id"]
            if pid not in self.encoded:
                self.encoded[pid] = encode_prompt(self.tok, self.prompts[pid]["prompt"],
                                                  self.task.chat)
            seed = task_seed(self.rl.seed, int(t["seq"])) if self.rl.agent.seeded else None
            for ep in self.agent.episodes(self.encoded[pid], self.rl.group_size, seed=seed):
                episodes.append((ep, t["server"]))
                owner.append(k)
        try:
            return (run_episodes(episodes, self.gens, self.rl.call_timeout, self.server_alive,
                                 self.past_stop_by), owner, "", False)
        except Exception as e:  # a server failed or was cut off: give the tasks back
            refused = unservable(e)
            if refused:  # (the server is fine: it refused this request)
                log.warning("a server refused the request: %s", e)
            else:
                self._failed(e)
                self._forget(sorted({t["server"] for t in tasks}))
            return [], owner, f"{type(e).__name__}: {e}", refused

    def group(self, t: Task, out: Outcome) -> GroupMessage:
        return {"seq": t["seq"], "prompt_id": t["prompt_id"], "worker": self.worker.index,
                "server": t["server"], "trajs": out.trajs, "failed": bool(out.error),
                "error": out.error, "unservable": out.refused, "agent_error": out.agent_error}

    def close(self) -> None:
        self.link.close()
        for c in self.gens.values():
            c.close()


def rollout_role(worker: RolloutWorker) -> dict[str, Any]:
    rl = rl_config(worker)
    r = _Rollouts(worker, rl)
    done = groups = failed = 0
    try:
        while not worker.stopping:
            try:
                # a master that dies or is restarted while we wait is noticed within 0.5 s
                reply = r.link.master.next_task(worker.index, rl.tasks_per_request,
                                                r.incarnation).result_while(
                    lambda: not r.link.moved(), 10.0, check_every=0.5)
            except RemoteError as e:
                if e.type_name == "WireError":
                    # the live master's answer could not be sent (a task it cannot encode):
                    # asking again would get it again, for ever
                    raise RuntimeError(f"the master failed to answer next_task: {e}") from e
                log.warning("next_task failed (%s): waiting for the master", e)
                r.link.reconnect()
                continue
            except RpcError as e:  # a restarted master (recover=auto) comes back elsewhere
                log.warning("next_task failed (%s): waiting for the master", e)
                r.link.reconnect()
                continue
            if reply.get("done"):
                done = 1
                break
            if "wait" in reply:
                time.sleep(float(reply["wait"]))
                continue
            tasks = reply["tasks"]
            for t, out in zip(tasks, r.run_tasks(tasks)):
                if not r.link.push(r.group(t, out)):
                    if not worker.stopping:
                        r.link.reconnect()
                    break
                groups += 1
                failed += bool(out.error)
    finally:
        r.close()
    return {"groups": groups, "failed": failed, "finished": bool(done)}

