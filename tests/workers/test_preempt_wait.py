"""A warned worker that holds training state waits for the master's checkpoint as long as Slurm
really leaves its job, not a fixed 90 s: real worker processes, a real file name resolution (the
test plays the master: it answers the checkpoint request, or not), and a real Slurm job's end."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from system import names
from system.bootstrap import Bootstrap
from system.errors import NameEntryNotFound
from system.name_resolve import FileNameResolve
from system.rpc import RpcClient
from system.wire import Codec
from tests.helpers import REPO, write_secret_file
from workers.checkpoint_window import PREEMPT_WAIT, checkpoint_wait
from workers.client import WorkerClient

# a worker that holds training state, as the master does: on SIGUSR2 it asks for a checkpoint
# and stops once it is committed; its role raises once stopped ("stopped during training")
PROBE = """
import logging, sys
from system.bootstrap import Bootstrap
from workers.base import Worker

class Probe(Worker):
    kind = "probe"

    def on_preempt(self):
        return self.stop_after_checkpoint()

def role(worker):
    while not worker.wait_stop(0.1):
        pass
    raise RuntimeError("stopped during training")

logging.basicConfig(level=logging.INFO, stream=sys.stdout)
sys.exit(Probe(Bootstrap.read(sys.argv[1]), 0).run(role))
"""


def _trial(tmp_path, warning: float) -> tuple[FileNameResolve, Codec]:
    secret = write_secret_file(str(tmp_path))
    Bootstrap(exp="pre", trial="t", experiment="smoke", trial_dir=str(tmp_path),
              interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
              name_resolve_root=str(tmp_path / "nr"), rpc={}, heartbeat_ttl=2.0,
              orphan_timeout=600.0, preempt_warning=warning
              ).write(str(tmp_path / "bootstrap.json"))
    return FileNameResolve(str(tmp_path / "nr"), secret=secret), Codec(secret)


def _start(tmp_path, nr: FileNameResolve, codec: Codec, env: dict | None = None
           ) -> subprocess.Popen:
    """Start the probe, configure and start it as the controller would (its liveness key
    kept up meanwhile)."""
    nr.add(names.controller("pre", "t"), "controller", keepalive_ttl=2.0)
    log = open(tmp_path / "probe.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", PROBE, str(tmp_path / "bootstrap.json")],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    client = WorkerClient(RpcClient(codec, nr.wait(names.worker_address("pre", "t", "probe", 0),
                                                   30), 10), "probe/0")
    try:
        client.configure({"worker": {}, "experiment": {}, "counts": {}, "recover": "off"}).result()
        client.start().result()
    finally:
        client.close()
    return proc


def _log(tmp_path) -> str:
    with open(tmp_path / "probe.log") as f:
        return f.read()


def _answer(nr: FileNameResolve, timeout: float = 20.0) -> None:
    """Play the master: once the probe's checkpoint request is there, commit (delete it)."""
    key = names.preempt("pre", "t", "probe", 0)
    nr.wait(key, timeout)
    nr.delete(key)


def test_no_checkpoint_within_the_warning_stops_the_worker_and_exits_0(tmp_path):
    """A 4 s warning leaves 2 s for the checkpoint; none comes: the worker stops then, and a
    role that raised because of that stop exits 0 (it stopped for a requeue, as asked; before,
    a master exited 1 and its Slurm job read FAILED)."""
    nr, codec = _trial(tmp_path, 4.0)
    proc = _start(tmp_path, nr, codec)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(timeout=30) == 0, _log(tmp_path)
        assert 2.0 <= time.monotonic() - t0 < 15.0
        log = _log(tmp_path)
        assert "probe/0 waits up to 2s for the trial's checkpoint\n" in log, log
        assert "probe/0: no checkpoint within 2s of SIGUSR2: stopping" in log, log
        assert "stopped by SIGUSR2 while its role ran" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        nr.close()


def test_a_committed_checkpoint_stops_the_worker_at_once(tmp_path):
    nr, codec = _trial(tmp_path, 0.0)  # (the local scheduler: up to 90 s)
    proc = _start(tmp_path, nr, codec)
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR2)
        _answer(nr)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0, _log(tmp_path)
        assert time.monotonic() - t0 < 10.0
        log = _log(tmp_path)
        assert f"waits up to {PREEMPT_WAIT:.0f}s" in log and "checkpoint committed" in log, log
        with pytest.raises(NameEntryNotFound):  # (not added back by the probe)
            nr.get(names.preempt("pre", "t", "probe", 0))
    finally:
        if proc.poll() is None:
            proc.kill()
        nr.close()


def test_a_checkpoint_committed_just_before_another_stop_is_still_said(tmp_path):
    """The master commits the checkpoint and, at once, the worker is stopped by another cause
    (the controller's recovery cancels its job once the master's job requeued), before its
    next look at the request: its log still says the checkpoint was committed (it said
    nothing; a real preemption on the test cluster failed on that)."""
    nr, codec = _trial(tmp_path, 0.0)
    proc = _start(tmp_path, nr, codec)
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR2)
        _answer(nr)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # (143: stopped by SIGTERM)
        log = _log(tmp_path)
        assert "probe/0: checkpoint committed after SIGUSR2" in log, log
        assert "no checkpoint within" not in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
        nr.close()


@pytest.mark.slurm
def test_the_wait_follows_the_end_slurm_gives_the_job(slurm_cluster, tmp_path):
    """Under Slurm the wait is sized by the job's own end (``scontrol``: its ``EndTime``), not
    by the warning's length: a job with a one-minute limit, warned after some seconds, leaves
    less than the 600 s warning the trial was set for."""
    env = slurm_cluster.env
    out = subprocess.run(["sbatch", "--parsable", "--time=1", "--job-name=preempt-wait",
                          f"--output={tmp_path}/job.log", "--wrap", "sleep 120"], env={
                              **os.environ, **env}, capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env={
                **os.environ, **env}, capture_output=True, text=True).stdout.strip()
            if state == "RUNNING":
                break
            time.sleep(0.5)
        assert state == "RUNNING", state
        nr, codec = _trial(tmp_path, 600.0)
        proc = _start(tmp_path, nr, codec, {**env, "SLURM_JOB_ID": job})
        try:
            proc.send_signal(signal.SIGUSR2)
            _answer(nr)
            assert proc.wait(timeout=30) == 0, _log(tmp_path)
            log = _log(tmp_path)
            found = re.search(r"waits up to (\d+)s for the trial's checkpoint; Slurm ends its "
                              r"job in (\d+)s", log)
            assert found, log
            wait, left = int(found[1]), int(found[2])
            assert 5 <= left <= 60, log  # (of the one-minute limit, some seconds gone)
            assert abs(wait - checkpoint_wait(left, 600.0)) <= 1, log
        finally:
            if proc.poll() is None:
                proc.kill()
            nr.close()
    finally:
        subprocess.run(["scancel", job], env={**os.environ, **env}, capture_output=True)


def test_a_later_signal_never_pushes_the_cut_further_out(monkeypatch):
    """SIGTERM's 5 s, then a SIGUSR2 (up to 90 s): the rollout worker still cuts at the first;
    and the look at Slurm's end only ever brings it nearer."""
    import types

    from workers.preempt_wait import cut_in_flight, tighten

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    worker = types.SimpleNamespace(stop_by=None, started_at=time.time(),
                                   boot=types.SimpleNamespace(preempt_warning=120.0))
    soon = time.monotonic() + 5.0
    tighten(worker, soon)
    cut_in_flight(worker)
    time.sleep(0.2)  # (its look: none outside Slurm)
    assert worker.stop_by == soon
    worker.stop_by = None
    cut_in_flight(worker)
    assert 80.0 < worker.stop_by - time.monotonic() <= 90.0  # the warning's, less 30 s
