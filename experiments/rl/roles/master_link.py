"""A rollout worker's link to the master: the RPC client it asks for tasks through, and the
pusher into the trajectory stream the master publishes. Each is replaced when the master is
found elsewhere: a restarted master (a recovery, a requeued job) registers its RPC address and
then publishes its stream, so a worker that connected in between may hold the address of the
old stream with the new master; it moves its pusher alone once the new stream is published."""
from __future__ import annotations

import logging
import time

from system import names
from system.errors import NameEntryNotFound, RpcError, RpcTimeout
from system.streams import StreamPusher
from workers.master import MasterClient
from workers.rollout import RolloutWorker
from workers.schema import GroupMessage

log = logging.getLogger("rl-rollout")

PUSH_WAIT = 1.0
"""Seconds one push waits for room in the stream's queue before the link looks again whether
the worker stops or the master moved."""


class MasterLink:
    """The master's RPC client and stream pusher of ``worker`` (see the module)."""

    def __init__(self, worker: RolloutWorker, startup_timeout: float) -> None:
        self.worker = worker
        self.startup_timeout = startup_timeout
        """How long :meth:`reconnect` waits for a master that has gone."""
        self._connect(worker.name_resolve.wait(self._master_key(), 60,
                                               stop=lambda: worker.stopping), 60.0)

    def _connect(self, address: str, stream_timeout: float) -> None:
        self.master_address = address
        self.master = MasterClient(self.worker.client(address, 30.0), "master/0")
        self.pusher: StreamPusher = self.worker.trajectory_stream(timeout=stream_timeout)

    @property
    def stream_address(self) -> str:
        """The stream the pusher pushes into."""
        return self.pusher.address

    def _master_key(self) -> str:
        return names.worker_address(self.worker.exp, self.worker.trial, "master", 0)

    def _stream_address(self) -> str | None:
        try:
            return self.worker.name_resolve.get(
                names.stream(self.worker.exp, self.worker.trial, "trajectories"))
        except NameEntryNotFound:
            return None

    def moved(self) -> bool:
        """The master serves, or streams, at an address other than the link's (it was
        restarted; or its stream was published after the link connected)."""
        try:
            address = self.worker.name_resolve.get(self._master_key())
        except NameEntryNotFound:
            return True
        return address != self.master_address or self._stream_address() != self.stream_address

    def reconnect(self) -> None:
        """Wait for the restarted master, then talk to it (its new task source does not know
        our old tasks: their groups would be dropped, so nothing in flight is kept). The same
        master, answering: only its stream is followed if it moved."""
        w = self.worker
        deadline = time.monotonic() + self.startup_timeout
        while not w.stopping:
            try:
                address = w.name_resolve.get(self._master_key())
                if address != self.master_address:
                    break
                if _answers(self.master):
                    self._follow_stream()
                    return
            except NameEntryNotFound:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the master did not come back within "
                                   f"{self.startup_timeout:.0f}s")
            time.sleep(0.5)
        else:
            return
        log.warning("the master moved to %s: reconnecting", address)
        self.master.close()
        self.pusher.close(linger=0)
        self._connect(address, self.startup_timeout)

    def _follow_stream(self) -> None:
        """Push into the stream the master publishes now, if it is not the link's."""
        address = self._stream_address()
        if address is None or address == self.stream_address:
            return
        log.warning("the master's stream moved to %s: pushing there", address)
        self.pusher.close(linger=0)
        self.pusher = self.worker.trajectory_stream(timeout=self.startup_timeout)

    def push(self, msg: GroupMessage) -> bool:
        """Push, retrying while the master's queue is full; gives up once stopping or once the
        master moved."""
        while True:
            try:
                self.pusher.send(msg, timeout=PUSH_WAIT)
                return True
            except RpcTimeout:
                if self.worker.stopping or self.moved():
                    return False

    def close(self) -> None:
        self.master.close()
        self.pusher.close(linger=0.5)


def _answers(master: MasterClient) -> bool:
    try:
        master.ping().result(1.0)
        return True
    except RpcError:
        return False
