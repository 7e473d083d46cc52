"""A rollout worker's link to the master follows it: a master that moved (restarted elsewhere)
gets a new client and pusher; the same master whose stream was published after the worker
connected (a requeued master registers its address first) gets the pusher moved alone. Before,
the worker kept pushing into the old stream: every push failed, and ``reconnect`` kept the
pusher because the master answered, for ever."""
from __future__ import annotations

import os
import threading
import time

import pytest

from experiments.rl.roles.master_link import MasterLink
from system import names
from system.bootstrap import Bootstrap
from system.errors import NameEntryNotFound
from system.streams import StreamPuller
from tests.helpers import write_secret_file
from workers.master import MasterWorker
from workers.rollout import RolloutWorker


@pytest.fixture
def trial(tmp_path):
    d = str(tmp_path)
    write_secret_file(d)
    boot = Bootstrap(exp="e", trial="t", experiment="smoke", trial_dir=d, interface="127.0.0.1",
                     scheduler="local", name_resolve={"type": "file"},
                     name_resolve_root=os.path.join(d, "nr"), rpc={}, heartbeat_ttl=5.0)
    rollout = RolloutWorker(boot, 0)
    started: list[tuple[MasterWorker, threading.Event, StreamPuller]] = []

    def start_master() -> tuple[MasterWorker, StreamPuller]:
        """A master worker serving its RPC surface, registered, with its trajectory stream
        bound; the stream is published with :func:`publish`."""
        master, stop = MasterWorker(boot, 0), threading.Event()
        threading.Thread(target=master.server.serve_forever, args=(stop,), daemon=True).start()
        rollout.name_resolve.add(names.worker_address("e", "t", "master", 0),
                                 master.server.address, replace=True)
        puller = StreamPuller(rollout.codec, "127.0.0.1")
        started.append((master, stop, puller))
        return master, puller

    def publish(puller: StreamPuller) -> None:
        rollout.name_resolve.add(names.stream("e", "t", "trajectories"), puller.address,
                                 replace=True)

    yield rollout, start_master, publish
    for master, stop, puller in started:
        stop.set()
        puller.close()
    rollout.server.close()


def _group(n: int) -> dict:
    return {"n": n}


def test_the_same_master_s_new_stream_gets_the_pushes(trial):
    rollout, start_master, publish = trial
    old_master, old_stream = start_master()
    publish(old_stream)
    master, stream = start_master()  # requeued: registered, its stream not yet published
    link = MasterLink(rollout, startup_timeout=10.0)
    try:
        assert link.master_address == master.server.address
        assert link.stream_address == old_stream.address and not link.moved()
        publish(stream)
        assert link.moved()
        link.reconnect()  # the master answers: its stream alone is followed
        assert link.master_address == master.server.address
        assert link.stream_address == stream.address and not link.moved()
        assert link.push(_group(1))
        assert stream.recv(5.0) == {"n": 1}
    finally:
        link.close()


def test_a_master_that_moved_gets_a_new_client_and_stream(trial):
    rollout, start_master, publish = trial
    old_master, old_stream = start_master()
    publish(old_stream)
    link = MasterLink(rollout, startup_timeout=10.0)
    try:
        assert link.push(_group(1)) and old_stream.recv(5.0) == {"n": 1}
        master, stream = start_master()
        publish(stream)
        assert link.moved()
        link.reconnect()
        assert link.master_address == master.server.address
        assert link.stream_address == stream.address and not link.moved()
        assert link.master.ping().result(5.0)["kind"] == "master"
        assert link.push(_group(2)) and stream.recv(5.0) == {"n": 2}
    finally:
        link.close()


def test_a_worker_told_to_stop_waits_no_longer_for_the_master_s_stream(trial):
    """A master that failed before it published its stream: the rollout workers waited for it
    up to 60 s, deaf to the stop (SIGTERM included), and were SIGKILLed."""
    rollout, start_master, publish = trial
    start_master()  # registered; its stream is never published
    threading.Timer(0.3, rollout.stop).start()
    t0 = time.monotonic()
    with pytest.raises(NameEntryNotFound, match="no longer waited for: stopping"):
        MasterLink(rollout, startup_timeout=10.0)
    assert time.monotonic() - t0 < 5
