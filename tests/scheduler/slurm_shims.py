"""Stand-ins for Slurm's commands that fail the way a busy or restarting slurmctld makes them
fail, in front of the real ones (the test Slurm's), for the tests of the scheduler's retries."""
from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

UNREACHABLE = ("echo '{command}: error: Unable to contact slurm controller (connect failure)' "
               ">&2\nexit 1")
"""What a command does while slurmctld cannot be reached ("{command}": its name)."""


@dataclasses.dataclass(frozen=True)
class Shim:
    """A stand-in command in ``bin_dir`` (put it first on ``PATH``) that counts its calls of
    interest in ``calls`` and runs ``real`` (the real command's path) after its failures."""

    bin_dir: Path
    calls: Path
    real: str

    def count(self) -> int:
        """How many calls of interest it has seen (failed or passed on)."""
        return self.calls.read_text().count("x") if self.calls.exists() else 0


def shim(tmp_path: Path, command: str, failing: int, then: str = UNREACHABLE,
         only: str | None = None) -> Shim:
    """A stand-in for Slurm's ``command`` whose first ``failing`` calls (those whose first
    argument is ``only``, if given) run the shell lines ``then`` instead (by default: cannot
    reach slurmctld), and that runs the real one otherwise."""
    bin_dir, calls = tmp_path / "bin", tmp_path / f"{command}-calls"
    bin_dir.mkdir(exist_ok=True)
    real = subprocess.run(["which", command], capture_output=True, text=True,
                          check=True).stdout.strip()
    body = (f"echo x >> {calls}\n"
            f"if [ $(wc -l < {calls}) -le {failing} ]; then\n"
            f"{then.format(command=command)}\nfi\n")
    if only is not None:
        body = f'if [ "$1" = {only} ]; then\n{body}fi\n'
    (bin_dir / command).write_text(f"#!/bin/sh\n{body}exec {real} \"$@\"\n")
    (bin_dir / command).chmod(0o755)
    return Shim(bin_dir, calls, real)


def requeue_setting(job_id: str) -> str:
    """Job ``job_id``'s ``Requeue=`` field, as ``scontrol show job`` says it."""
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                         text=True).stdout
    return next(w for w in out.split() if w.startswith("Requeue="))
