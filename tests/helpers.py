"""Shared test helpers (not fixtures): the repository root, free ports, launching trials and
reading their summaries, leftover-process checks, the tiny Qwen2 shape, a character tokenizer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from system.name_resolve import FileNameResolve

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def launch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "system.launch", *args]


def run_launch(*args: str, timeout: float = 180, env: dict | None = None
               ) -> subprocess.CompletedProcess:
    return subprocess.run(launch_argv(*args), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


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


class CharTok:
    """The arith-tiny tokenizer's behaviour: one character per token."""

    vocab = ["<pad>", "<s>", "</s>"] + list("0123456789+-*=[] ?()/")

    def encode(self, text, add_special_tokens=False):
        return [self.vocab.index(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < 3))
