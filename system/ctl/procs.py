"""A trial's processes on this machine, found and checked through ``/proc`` before anything is
signalled: a worker (or warm spare) runs ``system.launcher.run_worker --trial-dir <root>``, the
launcher that runs a local controller ``system.launch exp=E trial=T``. A recorded pid is only
signalled once its command line says it is one of these (pids are reused)."""
from __future__ import annotations

import os
import signal
import socket
import time


def cmdline(pid: int) -> list[str] | None:
    """The arguments of live process ``pid`` (None if gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    if state in ("Z", "X") or not raw:
        return None
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def is_worker(args: list[str], root: str) -> bool:
    """``args`` run a worker (or spare) of the trial in ``root``."""
    return any(a == "--trial-dir" and b == root for a, b in zip(args, args[1:]))


def is_launcher(args: list[str], exp: str, trial: str) -> bool:
    """``args`` run ``system.launch`` for ``exp/trial``."""
    return "system.launch" in args and f"exp={exp}" in args and f"trial={trial}" in args


def trial_processes(root: str) -> list[int]:
    """Pids of this machine's live workers and spares of the trial in ``root``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            args = cmdline(int(entry))
            if args is not None and is_worker(args, root):
                pids.append(int(entry))
    return sorted(pids)


def launcher_alive(pid: int, exp: str, trial: str) -> bool:
    args = cmdline(pid) if pid > 0 else None
    return args is not None and is_launcher(args, exp, trial)


def launcher_here(holder: dict | None, exp: str, trial: str) -> int:
    """The pid of the trial's lock ``holder`` when it is the trial's launcher, live on this
    machine (one that can be signalled from here); else 0."""
    pid = int((holder or {}).get("pid") or 0)
    here = (holder or {}).get("host") == socket.gethostname()
    return pid if here and launcher_alive(pid, exp, trial) else 0


def _signal(pid: int, sig: int) -> None:
    """``sig`` to ``pid``'s process group when it leads one (a worker: its own children go
    too), else to ``pid`` alone (a launcher shares its shell's group)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(pids: list[int], grace: float) -> list[int]:
    """SIGTERM each, SIGKILL those left after ``grace`` seconds; the pids still alive 5 s
    later (none, unless the kernel cannot kill them)."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    left = _wait_gone(pids, grace)
    for pid in left:
        _signal(pid, signal.SIGKILL)
    return _wait_gone(left, 5.0)


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if cmdline(p) is not None]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
