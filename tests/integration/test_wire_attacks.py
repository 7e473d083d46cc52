"""A live trial's sockets under attack, with real worker processes: replays of captured
messages, a request pushed into a stream, oversized frames, floods of frames and connections.

The attacker is another user of the cluster: it reaches the workers' addresses and sees their
traffic, but does not hold the trial secret. Captured frames are built here with the secret,
exactly as a worker sends them (a sniffer would record the same bytes).
"""
from __future__ import annotations

import dataclasses
import os
import re
import resource
import signal
import socket
import subprocess
import time
from typing import Any, Callable

import numpy as np
import pytest
import zmq

from system import names
from system.bootstrap import read_secret
from system.name_resolve import FileNameResolve
from system.replay import Sender
from system.rpc import RpcClient
from system.sockets import endpoint
from system.wire import Channel, Codec, recipient_id
from tests.helpers import REPO, launch_argv, trial_name_resolve
from workers.generation import GenerationClient

TRAJECTORIES = 4 * 2  # 4 rollout workers, 2 each: they finish before the attacks begin


@dataclasses.dataclass
class Trial:
    proc: subprocess.Popen
    fileroot: str
    nr: FileNameResolve
    codec: Codec
    addresses: dict[str, str]

    def client(self, name: str) -> RpcClient:
        return RpcClient(self.codec, self.addresses[name], timeout=20)

    def ping(self, name: str) -> dict[str, Any]:
        c = self.client(name)
        try:
            return c.call("ping")
        finally:
            c.close()


def _launch(fileroot: str, trial: str, *extra: str, nofile: int | None = None
            ) -> subprocess.Popen:
    out = open(os.path.join(os.path.dirname(fileroot), f"{trial}.out"), "w")

    def limit() -> None:  # the launcher and its workers: soft and hard limit on open files
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return subprocess.Popen(launch_argv("exp=smoke", f"trial={trial}",
                                        f"cluster.fileroot={fileroot}", "scheduler.stop_grace=3",
                                        f"smoke.trajectories_per_worker={TRAJECTORIES // 4}",
                                        "rpc.max_message_bytes=1048576", *extra),
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=limit)


def _connect(fileroot: str, trial: str, proc: subprocess.Popen, curve: bool = False) -> Trial:
    nr = trial_name_resolve(fileroot, "smoke", trial)
    workers = ("master/0", "generation/0", "generation/1")
    addresses = {w: nr.wait(names.worker_address("smoke", trial, *w.split("/")), timeout=120)
                 for w in workers}
    addresses["stream"] = nr.wait(names.stream("smoke", trial, "trajectories"), timeout=120)
    secret = read_secret(os.path.join(fileroot, "smoke", trial, "secret"))
    t = Trial(proc, fileroot, nr, Codec(secret, 1 << 20, curve=curve), addresses)
    _until(lambda: t.ping("master/0")["progress"].get("trajectories")  # rollouts are done
           == f"{TRAJECTORIES}/{TRAJECTORIES}", 120)
    return t


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def trial(tmp_path_factory):
    fileroot = str(tmp_path_factory.mktemp("attacks") / "runs")
    # (a 15 s heartbeat: a CI run of the fuzz trial saw a heartbeat thread starved for 10 s by
    # an attack on a loaded machine; that a flood leaves heartbeats refreshed is checked below)
    proc = _launch(fileroot, "attacks", "smoke.min_duration=900", "controller.heartbeat_ttl=15")
    try:
        yield _connect(fileroot, "attacks", proc)
    finally:
        _stop(proc)


def _until(cond: Callable[[], bool], timeout: float = 20) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


def _raw(kind: int, address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint(address))
    return sock


def _captured(codec: Codec, channel: Channel, address: str, payload: Any) -> list[bytes]:
    return [bytes(f) for f in Sender(codec, channel).seal(payload, recipient_id(address)).frames]


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def _echo_count(t: Trial, name: str) -> int:
    c = t.client(name)
    try:
        return GenerationClient(c, name).echo(np.arange(3)).result()["requests"]
    finally:
        c.close()


def test_a_replayed_request_has_no_effect_on_its_worker_or_another(trial):
    before = {g: _echo_count(trial, g) for g in ("generation/0", "generation/1")}
    captured = _captured(trial.codec, Channel.REQUEST, trial.addresses["generation/0"],
                         {"m": "echo", "a": {"tokens": np.arange(3)}})
    to0, to1 = _raw(zmq.DEALER, trial.addresses["generation/0"]), _raw(
        zmq.DEALER, trial.addresses["generation/1"])
    to0.send_multipart(captured)                    # the original, as the worker sent it
    assert to0.poll(10_000)
    to0.recv_multipart()
    to0.send_multipart(captured)                    # replayed to the same worker
    to1.send_multipart(captured)                    # and to another one
    _until(lambda: trial.ping("generation/0")["drops"]["replayed"] == 1)
    _until(lambda: trial.ping("generation/1")["drops"]["misdirected"] == 1)
    assert not to0.poll(200) and not to1.poll(10)   # no reply to either
    assert _echo_count(trial, "generation/0") == before["generation/0"] + 2
    assert _echo_count(trial, "generation/1") == before["generation/1"] + 1
    to0.close()
    to1.close()


def test_a_request_pushed_into_the_master_stream_is_dropped(trial):
    """The controller's ping, captured and pushed into the trajectory stream, and an authentic
    stream message of the wrong schema: both dropped and counted, the master keeps going."""
    push = _raw(zmq.PUSH, trial.addresses["stream"])
    push.send_multipart(_captured(trial.codec, Channel.REQUEST, trial.addresses["master/0"],
                                  {"m": "ping", "a": {}}))
    push.send_multipart(_captured(trial.codec, Channel.STREAM, trial.addresses["stream"],
                                  {"kind": "master", "index": 0}))
    _until(lambda: trial.ping("master/0")["progress"].get("dropped") == 2)
    assert trial.ping("master/0")["state"] == "running"
    push.close()


def test_an_oversized_frame_is_cut_before_it_is_buffered(trial):
    pid = trial.ping("generation/1")["pid"]
    hwm = _status_kib(pid, "VmHWM")
    socks = [_raw(zmq.DEALER, trial.addresses["generation/1"]) for _ in range(8)]
    frame = os.urandom(3 << 20) + b"x" * (512 << 10)  # 3.5 MiB: over the limit, under 4x
    for s in socks:
        s.send(frame, copy=False)
    huge = _raw(zmq.DEALER, trial.addresses["generation/1"])
    huge.send(np.zeros(64 << 20, np.uint8), copy=False)
    time.sleep(2)
    grown = (_status_kib(pid, "VmHWM") - hwm) / 1024
    assert grown < 8, f"peak memory grew {grown:.1f} MiB"  # 92 MiB were sent
    assert trial.ping("generation/1")["drops"]["oversized"] == 0  # cut by ZeroMQ, uncounted
    for s in (*socks, huge):
        s.close()


def test_a_flood_of_empty_frames_is_bounded(trial):
    pid = trial.ping("generation/1")["pid"]
    hwm, drops = _status_kib(pid, "VmHWM"), trial.ping("generation/1")["drops"]
    raw = _raw(zmq.DEALER, trial.addresses["generation/1"])
    raw.send_multipart([b""] * 500_000)             # one message of 500,000 empty frames
    for _ in range(50_000):                          # and 50,000 empty messages
        raw.send(b"")
    _until(lambda: trial.ping("generation/1")["drops"]["malformed"]
           >= drops["malformed"] + 50_000, 120)
    assert trial.ping("generation/1")["drops"]["oversized"] == drops["oversized"] + 1
    grown = (_status_kib(pid, "VmHWM") - hwm) / 1024
    assert grown < 48, f"peak memory grew {grown:.1f} MiB"  # about 1.1 MB on the wire
    raw.close()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_connections_leaves_the_worker_serving(trial):
    pid = trial.ping("generation/0")["pid"]
    with open(f"/proc/{pid}/limits") as f:
        soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", f.read()).groups()
    assert soft == hard  # raised at start-up
    host, port = endpoint(trial.addresses["generation/0"])[6:].rsplit(":", 1)
    base = _fds(pid)
    flood: list[socket.socket] = []

    def connect(n: int) -> None:
        for _ in range(n):
            s = socket.socket()
            s.connect((host, int(port)))
            flood.append(s)

    connect(1500)
    heartbeat = names.heartbeat("smoke", "attacks", "generation", 0)
    expires = trial.nr.read_many([heartbeat])[heartbeat].expires
    # for 6 s, and until its heartbeat was refreshed while the flood was held (each refresh
    # opens a file or a connection; one comes every 5 s), at most 25 s: once the flood's first
    # ones close (10 s after the worker took them), more come, twice at most (a CI run on a
    # loaded machine saw no refresh within the first 10 s: a starved heartbeat thread)
    held, t0, pinged, refreshed, more = 0, time.time(), 0.0, False, 2
    while time.time() - t0 < 6 or not refreshed and time.time() - t0 < 25:
        now_held = _fds(pid) - base
        held = max(held, now_held)
        if held >= 600 and now_held < 300 and more:
            connect(1000)
            more -= 1
        if time.time() - pinged > 0.5:
            assert trial.ping("generation/0")["state"] == "running"
            pinged = time.time()
            entry = trial.nr.read_many([heartbeat]).get(heartbeat)
            refreshed |= now_held >= 600 and entry is not None and entry.expires > expires
        time.sleep(0.05)
    # Far beyond the 344 connections that used to exhaust a worker. Not all 1,500 at once: on a
    # loaded machine the worker accepts them slowly, and the first ones close after 10 s (below).
    assert held >= 600
    assert refreshed, "its heartbeat was not refreshed while the flood was held"
    # connections that never complete ZeroMQ's handshake are closed after 10 s
    _until(lambda: _fds(pid) < base + 50, 30)
    for s in flood:
        s.close()


def test_a_worker_out_of_descriptors_fails_visibly(tmp_path):
    """With a low hard limit the same flood exhausts a worker's descriptors: it must fail, and
    say so, instead of silently losing its heartbeat."""
    fileroot = str(tmp_path / "runs")
    proc = _launch(fileroot, "fds", "smoke.min_duration=900", nofile=256)
    flood = []
    try:
        t = _connect(fileroot, "fds", proc)
        host, port = endpoint(t.addresses["generation/0"])[6:].rsplit(":", 1)
        for _ in range(400):
            s = socket.socket()
            flood.append(s)
            if s.connect_ex((host, int(port))):  # refused: the worker has already given up
                break
        proc.wait(timeout=120)
    finally:
        for s in flood:
            s.close()
        _stop(proc)
    with open(os.path.join(tmp_path, "fds.out")) as f:
        out = f.read()
    assert proc.returncode != 0
    assert "generation/0 ran out of file descriptors" in out, out[-3000:]


def test_with_curve_a_peer_without_the_secret_gets_nothing_buffered(tmp_path):
    """``rpc.curve=true``: the flood above, from a peer that cannot complete the CURVE handshake,
    costs the worker nothing; the trial's own clients (CURVE) are served."""
    fileroot = str(tmp_path / "runs")
    proc = _launch(fileroot, "curve", "smoke.min_duration=900", "rpc.curve=true",
                   "controller.heartbeat_ttl=15")
    try:
        t = _connect(fileroot, "curve", proc, curve=True)
        pid, echoed = t.ping("generation/1")["pid"], _echo_count(t, "generation/1")
        hwm = _status_kib(pid, "VmHWM")
        # a ZeroMQ socket without the keys never gets a connection to send on; raw TCP does
        raw = _raw(zmq.DEALER, t.addresses["generation/1"])
        raw.send_multipart(_captured(t.codec, Channel.REQUEST, t.addresses["generation/1"],
                                     {"m": "echo", "a": {"tokens": np.arange(3)}}), zmq.NOBLOCK)
        host, port = endpoint(t.addresses["generation/1"])[6:].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as tcp:
            tcp.settimeout(5)
            try:  # ZMTP 3.0 greeting (NULL mechanism), then 500,000 empty frames
                tcp.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 48
                            + b"\x01\x00" * 500_000)
            except OSError:
                pass  # the worker hung up
        time.sleep(3)
        grown = (_status_kib(pid, "VmHWM") - hwm) / 1024
        assert grown < 4, f"peak memory grew {grown:.1f} MiB"
        ping = t.ping("generation/1")
        assert ping["state"] == "running" and sum(ping["drops"].values()) == 0
        assert _echo_count(t, "generation/1") == echoed + 1  # the request without CURVE: lost
        raw.close(0)
    finally:
        _stop(proc)
