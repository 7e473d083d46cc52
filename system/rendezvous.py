"""Rendezvous of torch.distributed groups through name resolution: one TCPStore per group.

The rank that hosts a group starts a TCPStore on a free port of the trial's interface and
publishes ``host:port`` under a name-resolution key; the others wait for the key and connect.
Groups then form from the store (``ProcessGroupGloo(store, ...)``, a ``PrefixStore`` per
sub-group), independently of any process's default group, so trainer ranks and vLLM workers can
share one. torch is imported when a store is made, not by the launcher.

What a store does not stop, and what it does:

- torch's TCPStore has no authentication: whoever reaches its port can read, write and delete
  keys, and list them (``list_keys``). The store is bound to the trial's interface only (a
  socket we bind and hand over as ``master_listen_fd``; torch itself listens on every
  interface), which keeps it off other networks of the node but not from other users who reach
  that interface.
- Every key a group uses lies under a prefix derived from the trial secret and the group's name
  (:func:`store_prefix`), so a client without the secret cannot guess a key by name; it can
  still list them and then read, rewrite or delete them. The gloo/NCCL connections the group
  then opens are neither authenticated nor encrypted (see the README's security notes).
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable

from system.name_resolve import NameResolve
from system.wire import Codec


def store_prefix(codec: Codec, group: str) -> str:
    """The key prefix of group ``group``'s store: a MAC of the name under the trial secret."""
    return "g" + codec.derive(b"store-v1", group.encode(), 16).hex()


def _listening_socket(host: str) -> tuple[int, int]:
    """A TCP socket listening on a free port of ``host`` only: ``(port, fd)``; the caller owns
    the descriptor."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(1024)
        return sock.getsockname()[1], sock.detach()
    except BaseException:
        sock.close()
        raise


def host_store(name_resolve: NameResolve, key: str, host: str, world_size: int,
               timeout: float, prefix: str) -> Any:
    """Start the store of a ``world_size`` group on ``host`` (bound to that address only) and
    publish its address under ``key``; returns the store seen through ``prefix``
    (:func:`store_prefix`). The caller keeps it alive as long as the group lives."""
    import torch.distributed as dist

    port, fd = _listening_socket(host)
    try:  # torch's libuv server takes the descriptor over (and closes it with the store)
        store = dist.TCPStore(host, port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout),
                              master_listen_fd=fd, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise
    name_resolve.add(key, f"{host}:{port}", replace=True)
    return dist.PrefixStore(prefix, store)


def join_store(address: str, world_size: int, timeout: float, prefix: str) -> Any:
    """Connect to the store at ``host:port``, seen through ``prefix``. Each rank needs its own
    client: one blocked in ``wait`` holds its connection and would starve another rank's
    rendezvous."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(prefix, store)


def lookup_store(name_resolve: NameResolve, key: str, world_size: int, timeout: float,
                 prefix: str, stop: Callable[[], bool] | None = None) -> Any:
    """Wait for the address published under ``key`` (no longer once ``stop()`` says the
    caller is stopping) and connect to it."""
    return join_store(name_resolve.wait(key, timeout, stop=stop), world_size, timeout, prefix)
