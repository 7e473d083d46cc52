"""Which queued jobs ``system.ctl cancel`` sweeps by name: only those whose output (squeue's
``StdOut``) lies under the trial's own directory, never a same-named trial's under another file
root (pure: squeue's ``-O`` lines as Slurm 22.05 prints them)."""
from __future__ import annotations

from scheduler.slurm_jobs import NAMED_FORMAT, parse_named, stdout_under
from system.ctl.cancel import named_here
from system.ctl.slurm_query import _parse

FA, FB = "/tmp/x/fa/smoke/t1", "/tmp/x/fb/smoke/t1"

QUEUE = (  # squeue -h -u me -O NAMED_FORMAT: two trials smoke/t1 under two file roots
    "13|RUNNING|smoke_t1:model|/tmp/x/fb/smoke/t1/logs/slurm-model-%%j.log\n"
    "14|PENDING|smoke_t1:generation|/tmp/x/fb/smoke/t1/logs/slurm-generation-%%j.log\n"
    "17|PENDING|smoke_t1:model|/tmp/x/fa/smoke/t1/logs/slurm-model-%%j.log\n"
    "18+1|PENDING|smoke_t1:workers|/tmp/x/fa/smoke/t1/logs/slurm-workers-%%j.log\n"
    "19|RUNNING|smoke_t10:model|/tmp/x/fa/smoke/t10/logs/slurm-model-%%j.log\n"
    "20|RUNNING|smoke_t1:controller|/tmp/x/fa/smoke/t1/logs/controller.log\n"
    "21|RUNNING|smoke_t1:model|slurm-%j.out\n"
    "22|COMPLETING|smoke_t1:master|/tmp/x/fa/smoke/t1 b|x/logs/m.log\n")


def test_named_lines_carry_stdout_and_het_components():
    """One parser of ``squeue -O`` serves the launcher's leftover sweep and ``ctl cancel``."""
    jobs = {j.job_id: j for j in parse_named(QUEUE)}
    assert NAMED_FORMAT.split(",")[0].startswith("JobArrayID")  # 12+1, as squeue -o %i
    assert jobs["18+1"].stdout == "/tmp/x/fa/smoke/t1/logs/slurm-workers-%%j.log"
    assert jobs["22"].stdout == "/tmp/x/fa/smoke/t1 b|x/logs/m.log"  # StdOut last: may hold |
    assert jobs["14"].state == "PENDING" and jobs["14"].name == "smoke_t1:generation"


def test_short_lines_carry_the_pending_reason_and_node():
    jobs = _parse("7|PENDING|Resources|(null)|smoke_t1:model\n"
                  "13|RUNNING|None|n0|smoke_t1:x\n14|PENDING|None||smoke_t1:y\n")
    assert jobs["7"].reason == "Resources" and jobs["13"].reason == "" == jobs["14"].reason
    assert jobs["13"].node == "n0" and jobs["13"].name == "smoke_t1:x" and jobs["14"].node == ""


def test_only_jobs_writing_under_this_trial_are_swept():
    jobs = parse_named(QUEUE)
    assert named_here(jobs, "smoke", "t1", [FA]) == ["17", "18+1", "20"]
    assert named_here(jobs, "smoke", "t1", [FB]) == ["13", "14"]
    assert named_here(jobs, "smoke", "t1", ["/tmp/x/fc/smoke/t1"]) == []
    assert named_here(jobs, "smoke", "t1", ["/elsewhere", FB + "/"]) == ["13", "14"]


def test_a_heterogeneous_jobs_components_go_with_the_one_that_names_the_output():
    queue = ("30+0|RUNNING|smoke_t1:workers|/tmp/x/fa/smoke/t1/logs/w-%%j.log\n"
             "30+1|RUNNING|smoke_t1:workers|\n"
             "31+1|RUNNING|smoke_t1:workers|\n")  # (another trial's, no output)
    assert named_here(parse_named(queue), "smoke", "t1", [FA]) == ["30+0", "30+1"]


def test_stdout_under():
    assert stdout_under("/r/smoke/t1/logs/a.log", "/r/smoke/t1")
    assert stdout_under("/r/smoke/t1/eval/logs/a.log", "/r/smoke/t1")  # mode=eval's jobs
    assert not stdout_under("/r/smoke/t10/logs/a.log", "/r/smoke/t1")  # a prefix, not a dir
    assert not stdout_under("/r/smoke/t1", "/r/smoke/t1")
    assert not stdout_under("/r/smoke/t1/../t2/logs/a.log", "/r/smoke/t1")
    assert not stdout_under("logs/a.log", "/r/smoke/t1") and not stdout_under("", "/r/smoke/t1")
    # a file root with a %: Slurm 22.05 shows the pattern (% doubled), later ones the path
    assert stdout_under("/r/50%%/smoke/t1/logs/slurm-model-%%j.log", "/r/50%/smoke/t1")
    assert stdout_under("/r/50%/smoke/t1/logs/slurm-model-7.log", "/r/50%/smoke/t1")
