"""Control-plane benchmarks, each measured side by side with its bare baseline in one run.

    .venv/bin/python tests/benchmarks/control_plane.py          # or: make bench
    .venv/bin/python tests/benchmarks/control_plane.py --only rpc,tensor

Prints ``name: value`` lines:
- rpc_latency_ratio: our request/reply round trip / a bare pyzmq DEALER-ROUTER echo (target <= 1.5)
- tensor_throughput_ratio: 64 MiB tensor messages through our authenticated stream / bare pyzmq
  PUSH-PULL of the same bytes (target >= 0.6)
- rpc_latency_ratio_curve, tensor_throughput_ratio_curve: the same with ``rpc.curve`` on
  (CURVE-encrypted connections), measured in the same rounds as the two above
- startup_ratio: launch + register + configure 32 smoke workers / 32 bare processes importing the
  same modules (target <= 1.5)
- name_resolve_{file,redis}_ops_per_s: add+get+delete operations per second
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np
import zmq

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from system.name_resolve import FileNameResolve, RedisNameResolve  # noqa: E402
from system.rpc import RpcClient, RpcServer  # noqa: E402
from system.streams import StreamPuller, StreamPusher  # noqa: E402
from system.wire import Codec, new_secret  # noqa: E402

SECRET = new_secret()  # spawned children re-import this module: pass it to them explicitly
MiB = 1 << 20


# --- request/reply latency --------------------------------------------------------------------

def _bare_echo_server(q: mp.Queue) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    q.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        frames = sock.recv_multipart()
        if frames[-1] == b"quit":
            break
        sock.send_multipart(frames)


def _our_echo_server(q: mp.Queue, secret: bytes, curve: bool = False) -> None:
    stop = threading.Event()
    srv = RpcServer(Codec(secret, curve=curve), "127.0.0.1",
                    {"echo": lambda x: x, "quit": stop.set})
    q.put(srv.address)
    srv.serve_forever(stop, poll=0.5)


def rpc_latency(n: int = 4000) -> dict[str, float]:
    """Median round trip of each (bare, ours, ours with CURVE), with all servers up and calls
    interleaved one by one, so that whatever else the machine does affects all alike."""
    ctx = mp.get_context("spawn")
    queues = {k: ctx.Queue() for k in ("bare", "ours", "curve")}
    procs = [ctx.Process(target=_bare_echo_server, args=(queues["bare"],)),
             ctx.Process(target=_our_echo_server, args=(queues["ours"], SECRET)),
             ctx.Process(target=_our_echo_server, args=(queues["curve"], SECRET, True))]
    for p in procs:
        p.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(queues["bare"].get())
    clients = {"ours": RpcClient(Codec(SECRET), queues["ours"].get(), timeout=10),
               "curve": RpcClient(Codec(SECRET, curve=True), queues["curve"].get(), timeout=10)}
    payload = b"\x81\xa1x\x01"  # msgpack {"x": 1}, the same logical payload

    def bare() -> None:
        dealer.send_multipart([payload])
        dealer.recv_multipart()

    calls: dict[str, Callable[[], Any]] = {
        "bare": bare, "ours": lambda: clients["ours"].call("echo", x={"x": 1}),
        "curve": lambda: clients["curve"].call("echo", x={"x": 1})}
    samples: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for i in range(n + 500):
        for name in order[i % 3:] + order[:i % 3]:
            t = time.perf_counter()
            calls[name]()
            if i >= 500:  # warm-up
                samples[name].append(time.perf_counter() - t)
    dealer.send_multipart([b"quit"])
    for c in clients.values():
        c.submit("quit")
    for p in procs:
        p.join()
    dealer.close(0)
    for c in clients.values():
        c.close()
    return {k: statistics.median(v) for k, v in samples.items()}


# --- tensor throughput -------------------------------------------------------------------------

def _bare_pusher(address: str, n: int, nbytes: int) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(address)
    buf = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    for _ in range(n):
        sock.send(memoryview(buf), copy=False)
    sock.close(linger=-1)
    zmq.Context.instance().term()  # wait until zmq has sent (and released) the buffer


def _our_pusher(address: str, n: int, nbytes: int, secret: bytes, curve: bool) -> None:
    pusher = StreamPusher(Codec(secret, 1 << 31, curve=curve), address, hwm=4)
    t = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).view(np.float32)
    for i in range(n):
        pusher.send({"seq": i, "tensor": t}, timeout=120)
    pusher.close(linger=120)
    zmq.Context.instance().term()


def _bare_throughput(n: int, nbytes: int) -> float:
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 4)
    pull.bind("tcp://127.0.0.1:*")
    p = mp.get_context("spawn").Process(
        target=_bare_pusher, args=(pull.getsockopt_string(zmq.LAST_ENDPOINT), n, nbytes))
    p.start()
    pull.recv(copy=False)  # first message: both sides warm
    t = time.perf_counter()
    for _ in range(n - 1):
        frame = pull.recv(copy=False)
        assert len(frame.buffer) == nbytes
    bps = (n - 1) * nbytes / (time.perf_counter() - t)
    p.join()
    pull.close(0)
    return bps


def _our_throughput(n: int, nbytes: int, curve: bool = False) -> float:
    puller = StreamPuller(Codec(SECRET, 1 << 31, curve=curve), "127.0.0.1", hwm=4)
    p = mp.get_context("spawn").Process(target=_our_pusher,
                                        args=(puller.address, n, nbytes, SECRET, curve))
    p.start()
    puller.recv(120)
    t = time.perf_counter()
    for _ in range(n - 1):
        msg = puller.recv(120)
        assert msg["tensor"].nbytes == nbytes
    bps = (n - 1) * nbytes / (time.perf_counter() - t)
    p.join()
    assert puller.drops.total == 0
    puller.close()
    return bps


def tensor_throughput(n: int = 16, nbytes: int = 64 * MiB, rounds: int = 3
                      ) -> dict[str, float]:
    """Median over alternating rounds of bare, ours and ours with CURVE (bytes per second at
    the receiver)."""
    out: dict[str, list[float]] = {"bare": [], "ours": [], "curve": []}
    for _ in range(rounds):
        out["bare"].append(_bare_throughput(n, nbytes))
        out["ours"].append(_our_throughput(n, nbytes))
        out["curve"].append(_our_throughput(n, nbytes, curve=True))
    return {k: statistics.median(v) for k, v in out.items()}


# --- startup -----------------------------------------------------------------------------------

STARTUP_COUNTS = {"master": 1, "model": 2, "generation": 2, "rollout": 27}
# what a worker process has imported when it is configured (roles, and torch for the model
# workers' group, are imported after ``start``, so they are not part of either side)
KIND_MODULES = {kind: [f"workers.{'generation' if kind == 'generation' else kind}"]
                for kind in STARTUP_COUNTS}


def startup(root: str) -> tuple[float, float]:
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "system.launch", "exp=smoke", "trial=startup",
                        f"cluster.fileroot={root}", "controller.progress=false",
                        "smoke.trajectories_per_worker=1",
                        *[f"{k}.count={v}" for k, v in STARTUP_COUNTS.items() if k != "master"]],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    with open(os.path.join(root, "smoke", "startup", "summary.json")) as f:
        s = json.load(f)
    ours = s["t0_epoch"] + s["timeline_s"]["configured"] - t
    t = time.time()
    procs = []
    for kind, count in STARTUP_COUNTS.items():
        # (workers.kinds: run_worker imports it in main(), after its stacks listener is up)
        code = ("import system.launcher.run_worker, workers.kinds, "
                + ", ".join(KIND_MODULES[kind]))
        procs += [subprocess.Popen([sys.executable, "-c", code], cwd=REPO) for _ in range(count)]
    for p in procs:
        assert p.wait() == 0
    bare = time.time() - t
    return ours, bare


# --- name resolution ---------------------------------------------------------------------------

def nr_ops_per_s(nr, n: int = 2000) -> float:
    t = time.perf_counter()
    for i in range(n):
        nr.add(f"bench/t/k{i}", "v" * 40)
    for i in range(n):
        nr.get(f"bench/t/k{i}")
    for i in range(n):
        nr.delete(f"bench/t/k{i}")
    return 3 * n / (time.perf_counter() - t)


def start_redis() -> tuple[subprocess.Popen, int] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, port


def _report_latency() -> None:
    t = rpc_latency()
    print(f"rpc_latency_us_ours: {t['ours'] * 1e6:.1f}")
    print(f"rpc_latency_us_curve: {t['curve'] * 1e6:.1f}")
    print(f"rpc_latency_us_bare: {t['bare'] * 1e6:.1f}")
    print(f"rpc_latency_ratio: {t['ours'] / t['bare']:.2f}")
    print(f"rpc_latency_ratio_curve: {t['curve'] / t['bare']:.2f}")


def _report_throughput() -> None:
    bps = tensor_throughput()
    print(f"tensor_throughput_GBps_ours: {bps['ours'] / 1e9:.2f}")
    print(f"tensor_throughput_GBps_curve: {bps['curve'] / 1e9:.2f}")
    print(f"tensor_throughput_GBps_bare: {bps['bare'] / 1e9:.2f}")
    print(f"tensor_throughput_ratio: {bps['ours'] / bps['bare']:.2f}")
    print(f"tensor_throughput_ratio_curve: {bps['curve'] / bps['bare']:.2f}")


def _report_startup_and_name_resolve(sections: set[str]) -> None:
    with tempfile.TemporaryDirectory() as root:
        if "startup" in sections:
            ours, bare = startup(root)
            print(f"startup_s_ours_32_workers: {ours:.2f}")
            print(f"startup_s_bare_32_processes: {bare:.2f}")
            print(f"startup_ratio: {ours / bare:.2f}")
        if "name_resolve" in sections:
            # authenticated, as in a trial
            nr = FileNameResolve(os.path.join(root, "nr"), secret=SECRET)
            print(f"name_resolve_file_ops_per_s: {nr_ops_per_s(nr):.0f}")
    if "name_resolve" not in sections:
        return
    redis = start_redis()
    if redis is None:
        print("name_resolve_redis_ops_per_s: skipped (no redis-server)")
        return
    proc, port = redis
    try:
        nr = RedisNameResolve('127.0.0.1', port, secret=SECRET)
        print(f"name_resolve_redis_ops_per_s: {nr_ops_per_s(nr):.0f}")
    finally:
        proc.terminate()
        proc.wait()


SECTIONS = ("rpc", "tensor", "startup", "name_resolve")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default: all of {','.join(SECTIONS)})")
    sections = set(p.parse_args().only.split(","))
    if sections - set(SECTIONS):
        p.error(f"unknown sections {sorted(sections - set(SECTIONS))}; valid: {SECTIONS}")
    os.chdir(REPO)
    if "rpc" in sections:
        _report_latency()
    if "tensor" in sections:
        _report_throughput()
    _report_startup_and_name_resolve(sections)


if __name__ == "__main__":
    main()
