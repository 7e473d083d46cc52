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

import contextlib
import fcntl
import hashlib
import multiprocessing.util
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator, MutableMapping

RPC_VARIABLE = "VLLM_RPC_BASE_PATH"
PREFIX = "rlsys-vllm-"

LOCK = ".lock"

_made: dict[int, str] = {}  # by process id: a forked child makes its own
_locks: dict[int, int | None] = {}  # the lock each holds while it lives


def private_dir() -> str:
    """This process's directory, made on the first call and removed at its exit (after
    multiprocessing's own clean-up, which may have put its ``pymp-*`` directory there). The
    process holds a lock on its ``.lock`` file while it lives, so that the directories of
    processes that died without removing theirs (a warm spare's prepared engine is SIGKILLed)
    are removed when a new one is made on the same host (named ``rlsys-vllm-<host
    hash>-<pid>-...``; the lock, not the pid, tells: a pid may be another namespace's)."""
    path = _made.get(os.getpid())
    if path is None or not os.path.isdir(path):
        root, mine = tempfile.gettempdir(), f"{PREFIX}{_host()}-"
        _remove_orphans(root, mine)
        path = tempfile.mkdtemp(prefix=f"{mine}{os.getpid()}-", dir=root)
        _locks[os.getpid()] = _lock(path)
        _made[os.getpid()] = path
        multiprocessing.util.Finalize(None, _remove, args=(path, os.getpid()), exitpriority=-200)
    return path


def _host() -> str:
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


def _lock(path: str) -> int | None:
    """An exclusive lock on ``path``'s lock file, held by the returned descriptor (None: it is
    held already, by a live process)."""
    fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _remove_orphans(root: str, mine: str) -> None:
    """Remove this user's directories under ``root`` named ``<mine>...`` whose owner is gone:
    nobody holds their lock (a live owner's, or another user's, are left alone)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not (name.startswith(mine) and stat.S_ISDIR(st.st_mode)
                    and st.st_uid == os.getuid() and os.path.exists(os.path.join(path, LOCK))):
                continue  # (no lock file yet: its owner is making it)
            fd = _lock(path)
        except OSError:
            continue
        if fd is not None:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)


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
