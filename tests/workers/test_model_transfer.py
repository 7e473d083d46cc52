"""A model worker gives up a weight transfer to a generation server that stops serving, at
once, instead of waiting out the group's timeout (a peer that died before it connected is
otherwise noticed only then): an in-process model worker over a real file name resolution."""
from __future__ import annotations

import threading
import time

import pytest

from system import names
from system.bootstrap import Bootstrap
from system.name_resolve import FileNameResolve
from tests.helpers import write_secret_file
from workers.model import ModelWorker


@pytest.fixture
def worker(tmp_path):
    root = str(tmp_path / "nr")
    secret = write_secret_file(str(tmp_path))
    Bootstrap(exp="mt", trial="t", experiment="smoke", trial_dir=str(tmp_path),
              interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
              name_resolve_root=root, rpc={}, heartbeat_ttl=2.0,
              orphan_timeout=30.0).write(str(tmp_path / "bootstrap.json"))
    nr = FileNameResolve(root, secret=secret)
    w = ModelWorker(Bootstrap.read(str(tmp_path / "bootstrap.json")), 0)
    yield w, nr
    w.name_resolve.close()
    w.server.close()
    nr.close()


def _register(nr: FileNameResolve, index: int, address: str) -> None:
    nr.add(names.heartbeat("mt", "t", "generation", index), "1", replace=True,
           keepalive_ttl=60)
    nr.add(names.worker_address("mt", "t", "generation", index), address, replace=True)


def test_a_transfer_to_a_server_that_stops_serving_is_given_up(worker):
    w, nr = worker
    _register(nr, 0, "tcp://10.0.0.1:1")
    _register(nr, 1, "tcp://10.0.0.2:1")
    never = threading.Event()

    def restart_server_0() -> None:  # a restarted server registers at a new address
        time.sleep(0.3)
        _register(nr, 0, "tcp://10.0.0.1:2")
    threading.Thread(target=restart_server_0, daemon=True).start()
    t0 = time.monotonic()
    done, failed = w._while_serving({0: never.wait, 1: lambda: 7},
                                    {0: "tcp://10.0.0.1:1", 1: "tcp://10.0.0.2:1"},
                                    period=0.1)
    assert time.monotonic() - t0 < 15  # (the transfer itself never ends)
    assert done == {1: 7}
    assert set(failed) == {0} and "stopped serving" in failed[0]
    never.set()


def test_a_dead_server_and_a_failed_transfer_are_failures_with_their_cause(worker):
    w, nr = worker
    _register(nr, 0, "tcp://10.0.0.1:1")

    def reset() -> int:
        raise ConnectionResetError("peer closed")
    done, failed = w._while_serving({0: reset}, {0: "tcp://10.0.0.1:1"}, period=0.1)
    assert done == {} and failed == {0: "ConnectionResetError: peer closed"}
    never = threading.Event()
    nr.delete(names.heartbeat("mt", "t", "generation", 0))  # the controller saw it die
    t0 = time.monotonic()
    done, failed = w._while_serving({0: never.wait}, {0: "tcp://10.0.0.1:1"}, period=0.1)
    assert time.monotonic() - t0 < 15 and set(failed) == {0}  # (it never ends)
    never.set()
