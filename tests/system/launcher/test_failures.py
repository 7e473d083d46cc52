"""Which failure the controller acts on: a reported exception, or the death that caused it."""
from __future__ import annotations

from scheduler.jobs import JobState, JobStatus
from system.errors import WorkerFailure
from system.launcher.config import RecoverConfig
from system.launcher.failures import (call_failure_cause, job_failure, reported_failure,
                                      root_cause)
from system.launcher.recovery import Recovery

ORDER = ("model", "generation", "rollout", "master")
REPORT = ('{"type": "RemoteError", "message": "RuntimeError: Connection closed by peer",'
          ' "traceback": "Traceback...\\n"}')


def status(job: str, state: JobState, *workers: str, detail: str = "") -> JobStatus:
    return JobStatus(job, state, tuple(workers), tuple(f"/logs/{w.replace('/', '-')}.log"
                                                       for w in workers), detail)


def master_report() -> WorkerFailure:
    failure = reported_failure({"exp/trial/error/master/0": REPORT},
                               {"master/0": "/logs/master-0.log"})
    assert failure is not None and failure.worker == "master/0"
    return failure


def test_a_report_after_a_peer_died_names_the_dead_worker_and_then_the_reporter():
    statuses = [status("1", JobState.RUNNING, "master/0"),
                status("2", JobState.RUNNING, "model/0"),
                status("3", JobState.FAILED, "model/1", detail="killed by signal 9")]
    f = root_cause(master_report(), statuses)
    assert f.worker == "model/1" and f.also == ("master/0",)
    assert f.log_path == "/logs/model-1.log"
    lines = str(f).splitlines()
    assert lines[0].startswith("worker model/1 exited before the trial completed: FAILED "
                               "(killed by signal 9)")
    assert lines[-1] == "then worker master/0 raised RemoteError: RuntimeError: " \
        "Connection closed by peer"


def test_a_report_with_every_other_job_alive_is_the_failure_itself():
    report = master_report()
    alive = [status("1", JobState.RUNNING, "master/0"), status("2", JobState.PENDING, "model/0")]
    assert root_cause(report, alive) is report
    # the reporter's own job having ended (it exited after reporting) names nothing else
    ended = [status("1", JobState.FAILED, "master/0"), status("2", JobState.RUNNING, "model/0")]
    assert root_cause(report, ended) is report
    assert job_failure(ended, "x", excluding=["master/0"]) is None
    assert job_failure(ended, "x").worker == "master/0"


def test_a_stateless_death_that_made_the_master_raise_restarts_the_stateful_kinds():
    r = Recovery(RecoverConfig(), ("model", "master"), t0=0.0)
    f = root_cause(master_report(), [status("1", JobState.RUNNING, "master/0"),
                                     status("2", JobState.FAILED, "rollout/1")])
    assert f.worker == "rollout/1" and f.also == ("master/0",)
    # the master is dead too: every stateful kind restarts; not every rollout worker (a kind
    # of generation servers would each rebuild an engine): the dead one's ended job is seen
    # at the next poll and respawned alone
    assert r.restarts_stateful(f)
    assert r.kinds_to_restart(f, ORDER) == ("model", "master")
    assert not r.restarts_stateful(WorkerFailure("x", "rollout/1"))
    assert r.begin(f, failed_step=7).worker == "rollout/1"


def test_workers_that_reported_and_exited_are_not_taken_for_the_cause():
    """Several workers reporting (each exits right after): the one picked is not blamed on
    another reporter's ended job; a job that ended without a report still is."""
    ended = [status("1", JobState.FAILED, "master/0"), status("2", JobState.FAILED, "rollout/0"),
             status("3", JobState.RUNNING, "model/0")]
    report = master_report()
    assert root_cause(report, ended, reporters=["master/0", "rollout/0"]) is report
    assert root_cause(report, ended, reporters=["master/0"]).worker == "rollout/0"


def test_a_configuration_error_is_the_failure_whatever_else_ended():
    report = reported_failure({"e/t/error/master/0": REPORT.replace(
        '"traceback"', '"config": true, "traceback"')}, {})
    assert report is not None and report.config
    f = root_cause(report, [status("2", JobState.FAILED, "rollout/1")])
    assert f is report and not Recovery(RecoverConfig(), ("model", "master"),
                                        t0=0.0).should_recover(f)


def test_a_reported_configuration_error_is_one_line_and_never_retried():
    report = ('{"type": "ConfigError", "message": "rl.task.train_path=\'/x.jsonl\' does not '
              'exist on h1", "traceback": "Traceback (most recent call last): ...\\n", '
              '"config": true}')
    f = reported_failure({"exp/trial/error/rollout/0": report}, {"rollout/0": "/logs/r0.log"})
    assert f is not None and f.config and f.worker == "rollout/0"
    assert str(f) == ("worker rollout/0 raised ConfigError: rl.task.train_path='/x.jsonl' does "
                      "not exist on h1\nlog: /logs/r0.log")
    r = Recovery(RecoverConfig(), ("model", "master"), t0=0.0)
    assert not r.should_recover(f)
    assert r.should_recover(master_report())  # any other exception is
    # a report from an older worker (no "config" field) is an ordinary failure
    old = reported_failure({"k/master/0": REPORT}, {})
    assert old is not None and not old.config and "Traceback" in str(old)


def test_a_call_refused_by_a_worker_whose_job_was_cancelled_names_the_cancelled_job():
    failed = WorkerFailure("configure of worker generation/0 failed: RemoteError: cannot "
                           "configure a worker in state stopping; log: /logs/generation-0.log",
                           "generation/0", "/logs/generation-0.log")
    cancelled = [status("1", JobState.RUNNING, "master/0"),
                 status("2", JobState.CANCELLED, "generation/0", "generation/1")]
    f = call_failure_cause(failed, cancelled, "during configure")
    assert f is not None and f.worker == "generation/0"
    lines = str(f).splitlines()
    assert lines[0].startswith("worker generation/0, generation/1 exited during configure: "
                               "CANCELLED")
    assert lines[-1] == "then configure of worker generation/0 failed: RemoteError: cannot " \
        "configure a worker in state stopping; log: /logs/generation-0.log"
    # every job alive: the failed call is the failure
    assert call_failure_cause(failed, cancelled[:1], "during configure") is None
    # the called worker's own ended job is named before another one that ended too
    both = [status("3", JobState.FAILED, "rollout/0"), *cancelled]
    assert call_failure_cause(failed, both, "during configure").worker == "generation/0"
    other = [status("3", JobState.FAILED, "rollout/0"), cancelled[0]]
    assert call_failure_cause(failed, other, "during configure").worker == "rollout/0"
    # a job of several workers (Slurm) is named after the called one
    gen1 = WorkerFailure("configure of worker generation/1 failed", "generation/1")
    assert call_failure_cause(gen1, both, "during configure").worker == "generation/1"


def test_a_restarted_generation_server_s_endpoint_is_forgotten_with_it(tmp_path):
    """Its OpenAI endpoint stayed registered: agents of the OpenAI kind read the dead server's
    until the new one published its own. Another kind's index leaves it alone."""
    from system import names
    from system.launcher.failures import clear_worker_keys
    from system.name_resolve import FileNameResolve

    nr = FileNameResolve(str(tmp_path), secret=b"s" * 32)
    http = names.http_address("e", "t", 1)
    nr.add(http, "http://127.0.0.1:8001")
    clear_worker_keys(nr, "e", "t", ["model/1", "rollout/1"], stateful=False)
    assert nr.get(http) == "http://127.0.0.1:8001"
    clear_worker_keys(nr, "e", "t", ["generation/1"], stateful=False)
    assert nr.find_subtree(names.http_addresses("e", "t")) == []
    nr.close()
