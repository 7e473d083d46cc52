"""CPU placement on the local scheduler: the pure plan, and a worker applying its set."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scheduler.base import GroupSpec
from scheduler.config import LocalConfig
from scheduler.cpu_plan import (CpuBinding, CpuDemand, cpu_env, format_cpu_list, parse_cpu_list,
                                plan_cpus)
from scheduler.local import LocalScheduler
from system.errors import ConfigError
from system.paths import PROJECT_ROOT

RL = [CpuDemand("model", 1), CpuDemand("generation", 1)]


def test_cpu_lists_parse_and_format():
    assert parse_cpu_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpu_list(" 5 , 2-3,2") == (2, 3, 5)
    assert format_cpu_list((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "1;2", "-1", "1-"):
        with pytest.raises(ConfigError):
            parse_cpu_list(bad)


def test_auto_splits_training_from_generation():
    assert plan_cpus([0, 1], CpuBinding(), RL) == {"model/0": (0,), "generation/0": (1,)}
    # in proportion: 2 model workers, 1 server of tp 2 on 8 CPUs
    plan = plan_cpus(list(range(8)), CpuBinding(),
                     [CpuDemand("model", 2), CpuDemand("generation", 1, 2)])
    assert plan == {"model/0": (0, 1), "model/1": (2, 3), "generation/0": (4, 5, 6, 7)}
    # non-contiguous allowed CPUs are used as they are
    assert plan_cpus([3, 7], CpuBinding(), RL) == {"model/0": (3,), "generation/0": (7,)}


def test_auto_binds_nothing_without_two_sides_gpus_or_cpus():
    assert plan_cpus([0], CpuBinding(), RL) == {}
    assert plan_cpus([0, 1], CpuBinding(), RL, gpus=True) == {}
    assert plan_cpus([0, 1], CpuBinding(), [CpuDemand("generation", 2)]) == {}
    assert plan_cpus([0, 1], CpuBinding(mode="off"), RL) == {}


def test_more_workers_than_cpus_share_round_robin():
    plan = plan_cpus([0, 1], CpuBinding(), [CpuDemand("model", 2), CpuDemand("generation", 2)])
    assert plan == {"model/0": (0,), "model/1": (1,), "generation/0": (0,),
                    "generation/1": (1,)}


def test_explicit_sets_win_and_auto_fills_the_rest():
    b = CpuBinding(model="0-1", rollout="3")
    plan = plan_cpus([0, 1, 2, 3], b, [*RL, CpuDemand("rollout", 2)])
    assert plan == {"model/0": (0, 1), "rollout/0": (3,), "rollout/1": (3,),
                    "generation/0": (2,)}
    # off still honours explicit sets
    assert plan_cpus([0, 1], CpuBinding(mode="off", master="1"),
                     [*RL, CpuDemand("master", 1)]) == {"master/0": (1,)}


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="mode='some' is not one of auto, off"):
        CpuBinding(mode="some")
    with pytest.raises(ConfigError, match="model='x'"):
        CpuBinding(model="x")
    with pytest.raises(ConfigError, match=r"scheduler.local.cpus.model='4-5': CPUs 4-5 are not "
                                          r"allowed here \(allowed: 0-1\)"):
        plan_cpus([0, 1], CpuBinding(model="4-5"), RL)
    assert LocalConfig().cpus.mode == "auto"


def test_the_scheduler_gives_each_worker_its_set():
    sched = LocalScheduler(cpus={"model/0": (0,), "generation/0": (1,)})
    group = GroupSpec("model", 1, ("python", "-c", "pass"), {}, ("/tmp/x.log",))
    (proc,) = sched.plan(group).processes
    assert proc.env["RLSYS_CPUS"] == "0" and sched.cpus("model/0") == (0,)
    assert cpu_env({}, "rollout/0") == {}


_PROBE = """
import os, threading, time, json
started = threading.Event()
def spin():
    started.set(); time.sleep(2)
t = threading.Thread(target=spin); t.start(); started.wait()
from system.cpu_binding import bind_from_env
bound = bind_from_env()
if os.environ.get("PROBE_REBIND"):  # a spare's forked worker binds again, to its own set
    bound = bind_from_env({"RLSYS_CPUS": os.environ["PROBE_REBIND"]})
sets = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir('/proc/self/task')}
print(json.dumps({"bound": sorted(bound or []), "threads": sets,
                  "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_worker_moves_every_thread_onto_its_set():
    """Every thread, one started before the binding included (a spare's prepared engine)."""
    import json

    cpu = sorted(os.sched_getaffinity(0))[-1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=PROJECT_ROOT, capture_output=True,
                       text=True, env={**env, "RLSYS_CPUS": str(cpu)}, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bound"] == [cpu] and out["omp"] == "1"
    assert len(out["threads"]) >= 2
    assert all(s == [cpu] for s in out["threads"].values()), out
    # a user's own OMP_NUM_THREADS is kept (the set still binds)
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=PROJECT_ROOT, capture_output=True,
                       text=True, env={**env, "RLSYS_CPUS": str(cpu), "OMP_NUM_THREADS": "3"},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bound"] == [cpu] and out["omp"] == "3"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_second_binding_sizes_the_pools_to_the_worker_set():
    """A warm spare binds to its group's CPUs, then the worker it forks to its own: the
    worker's pools get its own count, not the group's (which the first binding wrote, not the
    user); a user's own OMP_NUM_THREADS survives both."""
    import json

    group = sorted(os.sched_getaffinity(0))[-2:]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    probe = {**env, "RLSYS_CPUS": ",".join(map(str, group)), "PROBE_REBIND": str(group[1])}
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=PROJECT_ROOT, capture_output=True,
                       text=True, env=probe, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["bound"] == [group[1]] and out["omp"] == "1", out
    r = subprocess.run([sys.executable, "-c", _PROBE], cwd=PROJECT_ROOT, capture_output=True,
                       text=True, env={**probe, "OMP_NUM_THREADS": "2"}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["omp"] == "2"


def test_every_kind_given_a_list_gets_it_through_the_registry():
    """Master and rollout workers have no GPU demand: their sets come from the worker counts."""
    from scheduler.config import SchedulerConfig
    from scheduler.gpu_plan import GpuDemand
    from scheduler.registry import make_scheduler

    cpu = sorted(os.sched_getaffinity(0))[0]
    cfg = SchedulerConfig(local=LocalConfig(gpus="none", spares=False,
                                            cpus=CpuBinding(master=str(cpu), rollout=str(cpu))))
    sched = make_scheduler(cfg, "e", "t", "/tmp/unused", 0o077,
                           [GpuDemand("model", 1, 1, "m"), GpuDemand("generation", 1, 1, "g")],
                           {"master": 1, "model": 1, "generation": 1, "rollout": 2})
    assert sched.cpus("master/0") == sched.cpus("rollout/1") == (cpu,)
