"""What every part of ``make gpu-check`` shares: ``name: value`` lines, one verdict line per
check (``<check>: PASS``, ``<check>: FAIL (<why>)``, ``<check>: SKIP (<why>)``), the reasons a
machine cannot run a check, and parsing verdicts back (the driver reads each part's output).

Imports nothing beyond the standard library at module level: a part must be able to say SKIP
on a machine that has only torch, transformers and safetensors (no ``make setup``)."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARITH_TINY = os.path.join(ROOT, ".models", "arith-tiny")
STATUSES = ("PASS", "FAIL", "SKIP")
_VERDICT = re.compile(r"^(?P<check>[A-Za-z0-9_]+): (?P<status>PASS|FAIL|SKIP)(?: \((?P<why>.*)\))?$")


def out(name: str, value: Any) -> None:
    """One ``name: value`` line (floats with 6 significant digits)."""
    if isinstance(value, float):
        value = f"{value:.6g}"
    print(f"{name}: {value}", flush=True)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one check."""

    check: str
    status: str
    why: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"verdict status {self.status!r} is not one of {list(STATUSES)}")
        if not re.fullmatch(r"[A-Za-z0-9_]+", self.check):
            raise ValueError(f"check name {self.check!r} must be letters, digits and _")
        if "\n" in self.why:
            raise ValueError("a verdict's reason is one line")

    def line(self) -> str:
        return f"{self.check}: {self.status}" + (f" ({self.why})" if self.why else "")

    def show(self) -> "Verdict":
        print(self.line(), flush=True)
        return self


def parse_verdicts(text: str) -> dict[str, Verdict]:
    """Every verdict line of a part's output, by check (the last one wins)."""
    found: dict[str, Verdict] = {}
    for raw in text.splitlines():
        m = _VERDICT.match(raw.strip())
        if m:
            found[m["check"]] = Verdict(m["check"], m["status"], m["why"] or "")
    return found


def exit_code(verdicts: list[Verdict]) -> int:
    """1 if a check failed, else 0 (a skip is not a failure)."""
    return 1 if any(v.status == "FAIL" for v in verdicts) else 0


def need(*modules: str) -> str | None:
    """Why one of ``modules`` cannot be imported (one line), or ``None`` when all can."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a package that breaks at import
            first = (str(e).splitlines() or [""])[0]
            return f"{name} is not importable ({type(e).__name__}: {first})"
    return None


def cuda_devices() -> int:
    """CUDA devices torch sees (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_skip(device: str) -> str | None:
    """Why ``device`` cannot be used here, or ``None``."""
    why = need("torch")
    if why:
        return why
    if device == "cuda" and cuda_devices() == 0:
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def model_skip(path: str) -> str | None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"no model at {os.path.relpath(path, ROOT)} (make setup builds it)"
    return None


def base_parser(doc: str, model: str = ARITH_TINY) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda (NCCL, bfloat16 where the engines use it) or cpu (gloo, float32): "
                         "the CPU twin that CI runs")
    ap.add_argument("--model", default=model)
    return ap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def abs_diffs(got: list[Any], want: list[Any]) -> tuple[float, float]:
    """Mean and max absolute difference of matching 1-d tensors (as float32)."""
    import torch

    d = torch.cat([(g.float().cpu() - w.float().cpu()).abs() for g, w in zip(got, want)])
    return float(d.mean()), float(d.max())


def random_seqs(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[Any]:
    """``n`` random sequences of lengths in [lo, hi] over the non-special ids (3..vocab-1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g) for k in lens]


def reference_logprobs(model_dir: str, seqs: list[Any], device: str = "cpu") -> list[Any]:
    """Per-token log-probs of a float32 Hugging Face forward of each sequence alone (no
    padding; TF32 off), on ``device``, returned on the CPU."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               local_files_only=True).to(device).eval()
    want = []
    with torch.no_grad():
        for s in seqs:
            s = s.to(device)
            logits = ref(s[None]).logits[0].float()
            want.append(torch.log_softmax(logits[:-1], -1).gather(1, s[1:, None])[:, 0].cpu())
    del ref
    return want


def sft_loss(lps: Any, idx: Any) -> Any:
    """Negative log-likelihood summed over tokens (the engines divide by global tokens)."""
    return -sum(lp.sum() for lp in lps)


def kill_group(pid: int) -> None:
    """SIGKILL every process left in the process group ``pid`` leads (a part's children: its
    ranks, a vLLM engine core)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_group(argv: list[str], output: IO[Any] | int = subprocess.PIPE,
                env: dict[str, str] | None = None) -> subprocess.Popen:
    """``argv`` in a process group (session) of its own, stdout and stderr to ``output``."""
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_group(argv: list[str], timeout: float, echo: bool = False,
              env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """Run ``argv`` in its own process group for at most ``timeout`` seconds; its output is
    read as it comes (and passed through with ``echo``). Returns its exit status (None: it ran
    past ``timeout``) and its output. Whatever it leaves behind is killed, past the deadline
    all of it: nothing it started can hold a GPU or the output pipe after this returns."""
    proc = start_group(argv, env=env)
    assert proc.stdout is not None
    chunks: list[str] = []

    def pump() -> None:
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace")
            chunks.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, name="part-output", daemon=True)
    reader.start()
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    kill_group(proc.pid)
    proc.wait()
    reader.join(10)
    return rc, "".join(chunks)
