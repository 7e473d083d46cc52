"""A private Slurm cluster on this host: real munged, slurmctld and slurmd daemons.

Everything lives under one root directory (config, key, state, spool, logs, fake GPU device
files); ports are picked free at start. Clients reach it through ``SLURM_CONF``.

Fake GPUs: each node's ``gpus`` gres files are character devices made with ``mknod`` (major
195, NVIDIA's), so slurmd accepts them and sets ``CUDA_VISIBLE_DEVICES`` per job step, and GPU
placement can be asserted on a CPU machine (an empty regular file, the fallback where ``mknod``
is not allowed, gives jobs no such variable: :attr:`SlurmTestCluster.char_gpus` says which).
``nodes`` > 1 runs one ``slurmd -N <name>`` per node name (``rlnode0``, ``rlnode1``, ...), each
with its own port, spool, pid and log files, all on this host.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
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


NVIDIA_MAJOR = 195
"""The character-device major number of NVIDIA GPUs (``/dev/nvidia<minor>``)."""


class SlurmTestCluster:
    def __init__(self, root: str, cpus: int = 32, memory_mb: int = 16000, gpus: int = 4,
                 nodes: int = 1) -> None:
        """``gpus`` fake GPUs on each of ``nodes`` nodes (one node: named after this host, as
        before; several: ``rlnode0`` ...)."""
        if nodes < 1 or gpus < 1:
            raise ValueError(f"nodes={nodes} and gpus={gpus} must be >= 1")
        self.root = os.path.abspath(root)
        self.cpus, self.memory_mb, self.gpus = cpus, memory_mb, gpus
        self.host = socket.gethostname().split(".")[0]
        self.node_names = [self.host] if nodes == 1 else [f"rlnode{i}" for i in range(nodes)]
        self.conf_path = os.path.join(self.root, "slurm.conf")
        self.char_gpus = False
        """Whether the fake GPUs are character devices (jobs then see CUDA_VISIBLE_DEVICES)."""

    @property
    def multi(self) -> bool:
        return len(self.node_names) > 1

    def gpu_dir(self, node: str) -> str:
        return os.path.join(self.root, "dev", node) if self.multi else os.path.join(self.root,
                                                                                    "dev")

    def _make_gpus(self) -> None:
        """``fgpu<i>`` per node: a character device (major 195, minor i) where mknod is
        allowed, else an empty file; one kind for the whole cluster."""
        paths = [os.path.join(self.gpu_dir(n), f"fgpu{i}") for n in self.node_names
                 for i in range(self.gpus)]
        try:
            for path in paths:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if os.path.lexists(path) and not stat.S_ISCHR(os.lstat(path).st_mode):
                    os.unlink(path)
                if not os.path.lexists(path):
                    minor = int(path.rsplit("fgpu", 1)[1])
                    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, minor))
            self.char_gpus = True
        except (PermissionError, OSError):
            for path in paths:
                if not os.path.lexists(path):
                    open(path, "a").close()
            self.char_gpus = all(stat.S_ISCHR(os.lstat(p).st_mode) for p in paths)

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
        for n in self.node_names if self.multi else ():
            os.makedirs(os.path.join(self.root, "spool", n), exist_ok=True)
        self._make_gpus()
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), undefined=jinja2.StrictUndefined)
        nodes = [{"name": n, "port": _free_port(), "gpu_dir": self.gpu_dir(n)}
                 for n in self.node_names]
        values = dict(cluster_name="rltest", host=self.host, root=self.root,
                      ctld_port=_free_port(), slurmd_port=nodes[0]["port"], cpus=self.cpus,
                      memory_mb=self.memory_mb, gpus=self.gpus, nodes=nodes, multi=self.multi)
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
        for node in self.node_names:
            self._run(["slurmd", "-f", self.conf_path, *(["-N", node] if self.multi else [])])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                               text=True, env={**os.environ, **self.env})
            states = dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)
            if r.returncode == 0 and set(states) == set(self.node_names) and all(
                    s in ("idle", "mixed", "allocated") for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster's nodes did not become idle within {timeout}s "
                           f"(sinfo: {r.stdout.strip() or r.stderr.strip()}); logs under "
                           f"{self.root}/log")

    def stop(self) -> None:
        """Cancel every job and stop the daemons (by their pid files)."""
        if os.path.exists(self.conf_path):
            subprocess.run(["scancel", "--full", "-u", "root"], capture_output=True,
                           env={**os.environ, **self.env}, timeout=30)
        slurmds = [f"{self.root}/slurmd-{n}.pid" for n in self.node_names] if self.multi \
            else [f"{self.root}/slurmd.pid"]
        for pidfile in (*slurmds, f"{self.root}/slurmctld.pid", f"{self.root}/munge/munged.pid"):
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
