"""The controller's watch over many workers, per name-resolution backend, measured in one run.

    .venv/bin/python tests/benchmarks/scale.py                      # 1,000 workers, both backends
    .venv/bin/python tests/benchmarks/scale.py --workers 100 --backends redis
    .venv/bin/python tests/benchmarks/scale.py --file-root /nfs/scratch/me/nr   # on NFS

Simulated workers do what a worker does in name resolution (``workers/base.py``): each has its
own authenticated name-resolution client, adds its heartbeat with a keep-alive TTL and its
address, and leaves the heartbeat to its keep-alive thread. They live ``--workers/--procs`` to a
process; one more process holds the worker that is killed to time detection. The backends are
the real ones (a file root, a redis-server started here) and the controller side is the
controller's own :class:`~system.launcher.watch.NameWatch`, polled every ``--poll`` seconds.

Prints ``name: value`` lines per backend (``file_...``, ``redis_...``):
- register_s: from "go" until the controller's listing shows every worker's address
  (target <= 10 s with redis at 1,000 workers)
- register_cpu_fraction: CPU time of the controller's thread listing the registered workers /
  wall time, during registration (a wait that lasts as long as the jobs queue)
- watch_cpu_fraction: CPU time of the watching thread (``time.thread_time``) / wall time while it
  polls (target <= 0.05 of one core at 1,000 workers)
- watch_cpu_ms_per_poll, watch_polls_per_s: CPU time of one poll, and the polls made per second
  (``1/--poll`` when a poll takes less than the interval; a slower one is also a slower watch:
  the CPU fraction alone hides that on a busy machine)
- detect_s: from SIGKILL of one worker's process until the watch no longer sees it beating
  (target <= 10 s; the heartbeat TTL is ``--ttl``)
- watch_ops_per_s: name-resolution operations (entries read, listings) the watch issued per second
- worker_ops_per_s: operations (heartbeat refreshes) all workers issued per second while watched
- redis_commands_per_s: every command the redis server processed per second while watched
- missed_polls: polls that found a worker not beating before any was killed; each is a
  simulated worker that did not refresh within the TTL (a machine too busy to run them: the
  keep-alive threads of all workers share its cores) or a watch error
- redis_expired_keys: keys redis expired while watched (heartbeats not refreshed in time:
  with missed_polls > 0 and expired keys, the workers were late, not the watch)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from system import names  # noqa: E402
from system.launcher.watch import NameWatch  # noqa: E402
from system.name_resolve import FileNameResolve, NameResolve, RedisNameResolve  # noqa: E402
from system.wire import new_secret  # noqa: E402

EXP, TRIAL, KIND = "scale", "t", "rollout"
INTS = ("missed_polls", "redis_expired_keys")


def _client(backend: dict[str, Any], secret: bytes) -> NameResolve:
    if backend["type"] == "file":
        return FileNameResolve(backend["root"], secret=secret)
    return RedisNameResolve("127.0.0.1", backend["port"], secret=secret)


def _host(backend: dict[str, Any], secret: bytes, indices: list[int], ttl: float,
          events: dict[str, Any], out: Any) -> None:
    """Worker process body: ``len(indices)`` simulated workers, each with its own client."""
    clients = [_client(backend, secret) for _ in indices]
    out.put(("ready", len(indices)))
    events["go"].wait()
    for i, nr in zip(indices, clients):  # what Worker.run does before it serves
        nr.add(names.heartbeat(EXP, TRIAL, KIND, i), str(os.getpid()), replace=True,
               keepalive_ttl=ttl)
        nr.add(names.worker_address(EXP, TRIAL, KIND, i), f"tcp://127.0.0.1:{20000 + i}",
               replace=True)
    if events.get("mark") is None:  # the victim waits on nothing (killed while waiting on an
        while True:                 # Event, it would leave the Event's lock in a bad state)
            time.sleep(60)
    for mark in ("mark", "mark2"):
        events[mark].wait()
        out.put((mark, sum(nr.ops["write"] + nr.ops["read"] + nr.ops["list"]
                           for nr in clients)))
    events["stop"].wait()
    for nr in clients:
        nr.close()


def _start_redis() -> tuple[subprocess.Popen, int]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (scripts/setup.sh installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--maxclients", "20000"],
                            stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("redis-server did not start")


def _redis_stats(port: int | None) -> tuple[int, int]:
    """Commands processed and keys expired so far by the redis server."""
    if port is None:
        return 0, 0
    import redis

    stats = redis.Redis(port=port).info("stats")
    return int(stats["total_commands_processed"]), int(stats["expired_keys"])


def _ops(nr: NameResolve) -> int:
    return nr.ops["read"] + nr.ops["list"] + nr.ops["write"]


def measure(backend: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Register ``args.workers`` workers, watch them, kill one; the figures of the module doc."""
    ctx = mp.get_context("spawn")
    secret = new_secret()
    events = {k: ctx.Event() for k in ("go", "mark", "mark2", "stop")}
    out = ctx.Queue()
    n = args.workers
    per = -(-(n - 1) // args.procs)
    chunks = [list(range(s, min(s + per, n - 1))) for s in range(0, n - 1, per)]
    chunks.append([n - 1])  # the victim, alone in its process
    victim_events = {"go": events["go"]}
    procs = [ctx.Process(target=_host, daemon=True,
                         args=(backend, secret, c, args.ttl,
                               victim_events if c is chunks[-1] else events, out))
             for c in chunks]
    for p in procs:
        p.start()
    for _ in procs:
        assert out.get(timeout=300)[0] == "ready"
    nr = _client(backend, secret)
    watch = NameWatch(nr, EXP, TRIAL, args.ttl)
    workers = [f"{KIND}/{i}" for i in range(n)]
    try:
        t0, cpu0 = time.monotonic(), time.thread_time()
        events["go"].set()
        while len(watch.registered()) < n:  # what Controller._wait_registered does
            if time.monotonic() - t0 > args.register_timeout:
                raise SystemExit(f"only {len(watch.registered())}/{n} registered within "
                                 f"{args.register_timeout}s")
            time.sleep(watch.registration_interval(0.02))
        fig: dict[str, float] = {"register_s": time.monotonic() - t0,
                                 "register_cpu_fraction": (time.thread_time() - cpu0) / (
                                     time.monotonic() - t0)}
        fig.update(_watch(watch, workers, events, out, len(procs) - 1, backend.get("port"),
                          args))
        procs[-1].kill()
        t_kill = time.monotonic()
        victim = workers[-1]
        while victim in watch.poll(workers).beating:
            if time.monotonic() - t_kill > 3 * args.ttl + 30:
                raise SystemExit(f"{victim} still beating {time.monotonic() - t_kill:.0f}s "
                                 "after it was killed")
            time.sleep(args.poll)
        fig["detect_s"] = time.monotonic() - t_kill
        return fig
    finally:
        events["stop"].set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        nr.clear_subtree(names.trial_root(EXP, TRIAL))
        nr.close()


def _watch(watch: NameWatch, workers: list[str], events: dict[str, Any], out: Any,
           nprocs: int, port: int | None, args: argparse.Namespace) -> dict[str, float]:
    """Poll like the controller for ``args.watch_s`` seconds; CPU and operation counts."""
    time.sleep(args.ttl)  # every keep-alive thread refreshing at its own phase
    events["mark"].set()
    marks = [out.get(timeout=60) for _ in range(nprocs)]
    ops0, (cmds0, expired0) = _ops(watch.nr), _redis_stats(port)
    missed = polls = 0
    wall0, cpu0 = time.monotonic(), time.thread_time()
    while time.monotonic() - wall0 < args.watch_s:
        view = watch.poll(workers)
        missed += len(view.beating) < len(workers)
        polls += 1
        time.sleep(args.poll)
    wall, cpu = time.monotonic() - wall0, time.thread_time() - cpu0
    (cmds, expired), ops = _redis_stats(port), _ops(watch.nr) - ops0
    events["mark2"].set()
    marks2 = [out.get(timeout=60) for _ in range(nprocs)]
    worker_ops = sum(m[1] for m in marks2) - sum(m[1] for m in marks)
    fig = {"watch_cpu_fraction": cpu / wall, "watch_cpu_ms_per_poll": cpu / polls * 1e3,
           "watch_polls_per_s": polls / wall, "watch_ops_per_s": ops / wall,
           "worker_ops_per_s": worker_ops / wall, "missed_polls": float(missed)}
    if port is not None:
        fig["redis_commands_per_s"] = (cmds - cmds0) / wall
        fig["redis_expired_keys"] = float(expired - expired0)
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1000, help="simulated workers (default 1000)")
    p.add_argument("--procs", type=int, default=8, help="processes they run in (default 8)")
    p.add_argument("--backends", default="file,redis", help="comma-separated: file,redis")
    p.add_argument("--ttl", type=float, default=5.0, help="heartbeat TTL (controller default)")
    p.add_argument("--poll", type=float, default=0.2, help="controller poll interval")
    p.add_argument("--watch-s", type=float, default=20.0, help="seconds the CPU is measured")
    p.add_argument("--register-timeout", type=float, default=300.0)
    p.add_argument("--file-root", default="", help="file backend root (default: a temp dir)")
    args = p.parse_args()
    backends = args.backends.split(",")
    if set(backends) - {"file", "redis"} or args.workers < 2 or args.procs < 1:
        p.error("--backends is a subset of file,redis; --workers >= 2; --procs >= 1")
    print(f"workers: {args.workers}")
    for b in backends:
        if b == "file":
            with tempfile.TemporaryDirectory(dir=args.file_root or None) as root:
                fig = measure({"type": "file", "root": root}, args)
        else:
            proc, port = _start_redis()
            try:
                fig = measure({"type": "redis", "port": port}, args)
            finally:
                proc.terminate()
                proc.wait(10)
        for k, v in fig.items():
            print(f"{b}_{k}: {v:.0f}" if k in INTS else f"{b}_{k}: {v:.3f}", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
