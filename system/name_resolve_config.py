"""Name resolution's configuration (``name_resolve.*``): the backend, where it is, and the
Redis password, read from a private file or the environment, never from a command line."""
from __future__ import annotations

import dataclasses
import enum
import os
from typing import ClassVar

from system.errors import ConfigError
from system.private_files import read_private_file

__all__ = ["PASSWORD_ENV", "NameResolveBackend", "NameResolveConfig", "redis_password"]

PASSWORD_ENV = "RLSYS_REDIS_PASSWORD"
"""The environment variable the Redis password may come from (see ``redis_password_file``)."""


class NameResolveBackend(str, enum.Enum):
    FILE = "file"
    REDIS = "redis"


@dataclasses.dataclass
class NameResolveConfig:
    """Where workers find each other."""

    type: NameResolveBackend = NameResolveBackend.FILE
    """Backend: ``file`` (a directory, shared filesystem on a cluster) or ``redis``."""
    file_root: str = ""
    """Directory of the ``file`` backend; empty means ``<cluster.fileroot>/.name_resolve``. Each
    user's entries live in ``<file_root>/<uid>/`` (mode 0700, refused unless owned by the user)."""
    redis_host: str = "127.0.0.1"
    """Redis server host (``redis`` backend)."""
    redis_port: int = 6379
    """Redis server port (``redis`` backend)."""
    redis_db: int = 0
    """Redis database number."""
    redis_password_file: str = ""
    """File holding the Redis password, yours and readable by you only (mode 0600 or 0400; refused
    otherwise); empty: the RLSYS_REDIS_PASSWORD environment variable, else no password. The
    password itself is never written to a config, a bootstrap file, a job script or a command
    line."""

    redis_outage_timeout: float = 30.0
    """Seconds a Redis server that stopped answering (restarted, failed over, a network blip)
    is retried before an operation fails. A server that restarted without its data gets back,
    from every live process, the entries that process had added."""

    RETIRED_KEYS: ClassVar[dict[str, str]] = {
        "redis_password": "a password given on the command line lands in config.yaml, job "
                          "scripts and the process list; put it in a file only you can read "
                          "(chmod 600) and set name_resolve.redis_password_file=PATH, or export "
                          f"{PASSWORD_ENV}"}

    def __post_init__(self) -> None:
        if isinstance(self.type, str):
            try:
                self.type = NameResolveBackend(self.type)
            except ValueError:
                raise ConfigError(
                    f"type={self.type!r} is not one of "
                    f"{[b.value for b in NameResolveBackend]}"
                ) from None
        if not 0 < self.redis_port < 65536:
            raise ConfigError(f"redis_port={self.redis_port} is not a valid port")
        if self.redis_outage_timeout < 0:
            raise ConfigError(f"redis_outage_timeout={self.redis_outage_timeout} must be >= 0")
        if self.redis_password_file:  # workers may start elsewhere: keep an absolute path
            self.redis_password_file = os.path.abspath(os.path.expanduser(self.redis_password_file))


def redis_password(cfg: NameResolveConfig) -> str:
    """The Redis password: from ``cfg.redis_password_file`` (a private file of this user), else
    from the environment variable :data:`PASSWORD_ENV`, else none."""
    if not cfg.redis_password_file:
        return os.environ.get(PASSWORD_ENV, "")
    try:
        data = read_private_file(cfg.redis_password_file, "the Redis password file "
                                 "(name_resolve.redis_password_file)", (0o600, 0o400))
    except FileNotFoundError:
        raise ConfigError(f"name_resolve.redis_password_file={cfg.redis_password_file}: "
                          "no such file") from None
    password = data.decode().rstrip("\r\n")
    if not password:  # (it would mean no password at all)
        raise ConfigError(f"name_resolve.redis_password_file={cfg.redis_password_file} is "
                          "empty; valid: a file holding the password")
    return password
