"""The per-trial API key of the generation servers' OpenAI-compatible HTTP endpoints.

The launcher writes ``<trial_dir>/api_key`` (mode 0600) with the trial's secret, before any
worker starts; every generation server reads it and requires ``Authorization: Bearer <key>``.
An operator (or an external agent run by the trial's owner) reads the same file. Like the secret,
a new key is written at every launch.
"""
from __future__ import annotations

import os
import secrets
import stat

from system.errors import ConfigError

API_KEY_BYTES = 32
"""Random bytes in a key (written as URL-safe base64, 43 characters)."""


def new_api_key() -> str:
    return secrets.token_urlsafe(API_KEY_BYTES)


def write_api_key(path: str) -> str:
    """Create a fresh key at ``path``, readable by the owner only (mode 0600); an older file is
    replaced. Returns the key."""
    key = new_api_key()
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def read_api_key(path: str) -> str:
    """The key at ``path``; :class:`~system.errors.ConfigError` when the file is missing, empty,
    not a regular file or readable by anyone but its owner (a leaked key would open the
    endpoint to every user of the cluster)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"cannot read the trial's API key {path}: {e} (the launcher writes "
                          "it when it prepares the trial directory)") from e
    with os.fdopen(fd) as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode) or mode & 0o077:
            raise ConfigError(f"the API key file {path} must be a regular file of mode 0600, "
                              f"is {stat.filemode(mode)}")
        key = f.read().strip()
    if len(key) < 16:
        raise ConfigError(f"the API key in {path} is too short ({len(key)} characters)")
    return key
