"""Files only their owner may touch, on a filesystem other users share.

Every process of a trial creates files under a umask of 077 (``cluster.group_readable=true``:
027), so logs, configs, checkpoints and scripts are 0600/0700 (0640/0750). What a trial trusts
is checked before it is used: the secret and the Redis password file must be regular files owned
by the user and unreadable by anyone else; the trial directory and a user's name-resolution
directory must be directories (not links) owned by the user. A check that fails raises
:class:`~system.errors.UnsafeFileError` naming the path, its owner or mode, and the fix.
"""
from __future__ import annotations

import os
import pwd
import stat
import uuid

from system.errors import UnsafeFileError

PRIVATE_UMASK = 0o077
GROUP_UMASK = 0o027


def umask_for(group_readable: bool) -> int:
    """The file-creation mask of a trial's processes."""
    return GROUP_UMASK if group_readable else PRIVATE_UMASK


def dir_mode(group_readable: bool) -> int:
    return 0o777 & ~umask_for(group_readable)


def file_mode(group_readable: bool) -> int:
    return 0o666 & ~umask_for(group_readable)


def set_umask(group_readable: bool) -> int:
    """Set this process's umask (inherited by its children; ``sbatch`` passes it on to jobs as
    ``SLURM_UMASK``); returns the mask."""
    mask = umask_for(group_readable)
    os.umask(mask)
    return mask


def owner(uid: int) -> str:
    """``uid 65534 (nobody)``."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _refuse_foreign(path: str, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.getuid():
        raise UnsafeFileError(f"{what} {path} is owned by {owner(st.st_uid)}, not by you "
                              f"({owner(os.getuid())}): refusing to trust it")


def read_private_file(path: str, what: str, modes: tuple[int, ...] = (0o600,)) -> bytes:
    """The bytes of ``path``, a regular file (not a link) owned by this user whose mode is one
    of ``modes``; :class:`UnsafeFileError` otherwise (``FileNotFoundError`` if absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):
            raise UnsafeFileError(f"{what} {path} is a symbolic link: refusing to follow "
                                  "it") from e
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{what} {path} is not a regular file")
        _refuse_foreign(path, st, what)
        mode = stat.S_IMODE(st.st_mode)
        if mode not in modes:
            raise UnsafeFileError(
                f"{what} {path} has mode {mode:04o}; it must be "
                f"{' or '.join(f'{m:04o}' for m in modes)} (chmod {modes[0]:o} {path})")
        return f.read()


def check_owned_dir(path: str, what: str) -> os.stat_result:
    """``path`` is a directory (not a link) owned by this user; :class:`UnsafeFileError`
    otherwise."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(f"{what} {path} is a symbolic link: refusing to use it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(f"{what} {path} is not a directory")
    _refuse_foreign(path, st, what)
    return st


def check_private_parent(path: str, what: str) -> None:
    """The directory holding ``path`` is this user's and nobody else may write there (so a file
    in it cannot be swapped)."""
    parent = os.path.dirname(os.path.abspath(path))
    st = check_owned_dir(parent, f"the directory of {what}")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise UnsafeFileError(f"the directory of {what}, {parent}, has mode "
                              f"{stat.S_IMODE(st.st_mode):04o}: others may write there "
                              f"(chmod go-w {parent})")


def ensure_owned_dir(path: str, mode: int, what: str, adjust: bool = True) -> str:
    """Create directory ``path`` with ``mode`` if absent (its parents under the umask, existing
    ones left as they are); refuse one that is a link or another user's; give it ``mode``
    (``adjust=False``: an existing one keeps its own)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = check_owned_dir(path, what)
    if adjust and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    return path


def ensure_shared_dir(path: str) -> str:
    """A directory every user of a shared file root creates their own entry in: created like
    ``/tmp`` (1777: anyone may add, only an entry's owner may remove or rename it) when absent;
    an existing one is left as it is, unless it is a link, or others may write there without
    the sticky bit (they could rename a user's entries away) and it is neither ours nor
    root's (:class:`UnsafeFileError`)."""
    if os.path.lexists(path):
        st = os.lstat(path)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise UnsafeFileError(f"the shared directory {path} is a link or not a directory")
        if mode & 0o022 and not mode & stat.S_ISVTX and st.st_uid not in (0, os.getuid()):
            raise UnsafeFileError(f"the shared directory {path} (mode {mode:04o}, uid "
                                  f"{st.st_uid}) lets others rename your entries away: it "
                                  "needs the sticky bit (chmod +t), or use a root of your own")
    if not os.path.isdir(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o1777)
        except FileExistsError:
            pass
    return path


def write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` atomically (a fresh temp file renamed over it, never following a link)
    with exactly ``mode``."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # the umask may have taken bits ``mode`` asks for
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
