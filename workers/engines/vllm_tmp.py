"""A private temporary directory for the vLLM engines of one process, removed when it exits.

vLLM leaves files in the system's temporary directory at every engine start and never removes
them: the gloo rendezvous file of its workers (``vllm_dist_<hex>``) and, when its engine core runs
in processes of its own, seven ZeroMQ ``ipc://`` socket files; thousands after a day of runs on a
node. While an engine is built, its temporary files go to one directory of this process's own
instead (short, under the system's temporary directory: a socket path is limited to 107 bytes),
and the engine's own processes inherit it; the directory is removed when this process exits,
or, if it was killed, when a later process of the same user on the same host makes its own.

vLLM puts its compile caches elsewhere (``VLLM_CACHE_ROOT``), so nothing kept across runs moves.
A socket directory the user named with ``VLLM_RPC_BASE_PATH`` is used as it is.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator, MutableMapping

RPC_VARIABLE = "VLLM_RPC_BASE_PATH"
PREFIX = "rlsys-vllm-"

_made: dict[int, str] = {}  # by process id: a forked child makes its own


def private_dir() -> str:
    """This process's directory, made on the first call and removed at its exit. Named after
    this host and process (``rlsys-vllm-<host hash>-<pid>-<random>``), so that the directories
    of this host's processes that died without removing theirs (a warm spare's prepared engine
    is SIGKILLed) are removed when a new one is made."""
    path = _made.get(os.getpid())
    if path is None or not os.path.isdir(path):
        root, mine = tempfile.gettempdir(), f"{PREFIX}{_host()}-"
        _remove_orphans(root, mine)
        path = tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}-", dir=root)
        _made[os.getpid()] = path
        atexit.register(_remove, path, os.getpid())
    return path


def _host() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _remove_orphans(root: str, mine: str) -> None:
    """Remove this user's directories under ``root`` named ``<mine><pid>-...`` whose process
    is gone (one that runs, or another user's, is left alone)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name[len(mine):].split("-", 1)[0] if name.startswith(mine) else ""
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        return True
    return True


@contextlib.contextmanager
def engine_temp_dir(environ: MutableMapping[str, str] = os.environ) -> Iterator[str]:
    """While vLLM builds an engine: ``tempfile`` in this process and ``TMPDIR`` for the engine's
    processes point at :func:`private_dir`; vLLM's sockets go there for good (vLLM may freeze
    its reading of the variable, so it is set once and never changed)."""
    path = private_dir()
    named = environ.get(RPC_VARIABLE, "")
    if not named or os.path.basename(named).startswith(PREFIX):  # (a forked parent's: ours)
        environ[RPC_VARIABLE] = path
    saved_env, saved_tempdir = environ.get("TMPDIR"), tempfile.tempdir
    environ["TMPDIR"], tempfile.tempdir = path, path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            environ.pop("TMPDIR", None)
        else:
            environ["TMPDIR"] = saved_env


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that exits through atexit
        shutil.rmtree(path, ignore_errors=True)
