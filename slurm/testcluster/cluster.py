"""A private single-node Slurm cluster: real munged, slurmctld and slurmd daemons.

Everything lives under one root directory (config, key, state, spool, logs, fake GPU device
files); ports are picked free at start. Clients reach it through ``SLURM_CONF``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import jinja2

HERE = os.path.dirname(os.path.abspath(__file__))
DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(RuntimeError):
    """The Slurm or munge binaries are missing (install them with scripts/setup.sh as root)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmTestCluster:
    def __init__(self, root: str, cpus: int = 32, memory_mb: int = 16000, gpus: int = 4) -> None:
        self.root = os.path.abspath(root)
        self.cpus, self.memory_mb, self.gpus = cpus, memory_mb, gpus
        self.host = socket.gethostname().split(".")[0]
        self.conf_path = os.path.join(self.root, "slurm.conf")

    @staticmethod
    def available() -> str | None:
        """``None`` if every binary is installed, else what is missing."""
        missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol",
                               "scancel", "sinfo") if shutil.which(b) is None]
        if missing:
            return f"missing {', '.join(missing)}"
        if os.geteuid() != 0:
            return "not root (the test cluster runs its daemons as root)"
        return None

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": self.conf_path}

    def _write_files(self) -> None:
        for d in ("state", "spool", "log", "munge", "dev"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        for i in range(self.gpus):
            open(os.path.join(self.root, "dev", f"fakegpu{i}"), "a").close()
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), undefined=jinja2.StrictUndefined)
        values = dict(cluster_name="rltest", host=self.host, root=self.root,
                      ctld_port=_free_port(), slurmd_port=_free_port(), cpus=self.cpus,
                      memory_mb=self.memory_mb, gpus=self.gpus)
        for name in ("slurm.conf", "gres.conf"):
            with open(os.path.join(self.root, name), "w") as f:
                f.write(env.get_template(name + ".j2").render(**values))
        key = os.path.join(self.root, "munge", "munge.key")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        os.chmod(os.path.join(self.root, "munge"), 0o700)

    def _run(self, argv: list[str]) -> None:
        r = subprocess.run(argv, capture_output=True, text=True,
                           env={**os.environ, **self.env}, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({r.returncode}): {r.stderr.strip()}\n"
                               f"logs: {os.path.join(self.root, 'log')}")

    def start(self, detach: bool = False, timeout: float = 60) -> None:
        why = self.available()
        if why:
            raise SlurmUnavailable(why)
        self.stop()
        self._write_files()
        m = os.path.join(self.root, "munge")
        self._run(["munged", "--force", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                   f"--pid-file={m}/munged.pid", f"--log-file={self.root}/log/munged.log",
                   f"--seed-file={m}/munged.seed"])
        self._run(["slurmctld", "-c", "-f", self.conf_path])   # -c: start with a clean state
        self._run(["slurmd", "-f", self.conf_path])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                               env={**os.environ, **self.env})
            if r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster's node did not become idle within {timeout}s "
                           f"(sinfo: {r.stdout.strip() or r.stderr.strip()}); logs under "
                           f"{self.root}/log")

    def stop(self) -> None:
        """Cancel every job and stop the daemons (by their pid files)."""
        if os.path.exists(self.conf_path):
            subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True,
                           env={**os.environ, **self.env}, timeout=30)
        for pidfile in (f"{self.root}/slurmd.pid", f"{self.root}/slurmctld.pid",
                        f"{self.root}/munge/munged.pid"):
            _kill_pidfile(pidfile)


def _kill_pidfile(path: str, timeout: float = 15) -> None:
    try:
        with open(path) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
