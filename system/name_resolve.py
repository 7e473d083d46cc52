"""Name resolution: where workers publish addresses, heartbeats, versions and store addresses.

Keys are slash-separated paths under ``<exp>/<trial>/`` (see :mod:`system.names`). Two backends
share one API: ``file`` (a directory, possibly on NFS: atomic write-then-rename, exclusive create
by ``link``, no file locks, TTL via expiry timestamps checked on read) and ``redis`` (a real Redis
server: native TTLs, SCAN not KEYS).

Values are authenticated with the trial's secret (:mod:`system.name_auth`): an entry not written
by a holder of the secret reads as absent. Each user has a namespace of their own: the ``file``
backend keeps a user's entries in ``<root>/<uid>/`` (mode 0700, refused unless the user owns it),
the ``redis`` backend under the key prefix ``rlsys:<uid>:``.
"""
from __future__ import annotations

from system.name_resolve_api import Entry, NameResolve
from system.name_resolve_config import (PASSWORD_ENV, NameResolveBackend, NameResolveConfig,
                                        redis_password)
from system.name_resolve_file import FileNameResolve
from system.name_resolve_redis import RedisNameResolve

__all__ = ["PASSWORD_ENV", "Entry", "FileNameResolve", "NameResolve", "NameResolveBackend",
           "NameResolveConfig", "RedisNameResolve", "make_name_resolve", "redis_password"]


def make_name_resolve(cfg: NameResolveConfig, default_file_root: str, secret: bytes | None
                      ) -> NameResolve:
    """Build the backend named by ``cfg`` for the trial whose secret is ``secret``."""
    if cfg.type == NameResolveBackend.FILE:
        return FileNameResolve(cfg.file_root or default_file_root, secret=secret)
    return RedisNameResolve(cfg.redis_host, cfg.redis_port, cfg.redis_db, redis_password(cfg),
                            secret=secret, outage_timeout=cfg.redis_outage_timeout)
