"""Rendezvous of torch.distributed groups through name resolution: one TCPStore per group.

The rank that hosts a group starts a TCPStore on a free port and publishes ``host:port`` under a
name-resolution key; the others wait for the key and connect. Groups then form from the store
(``ProcessGroupGloo(store, ...)``, a ``PrefixStore`` per sub-group), independently of any
process's default group, so trainer ranks and vLLM workers can share one. torch is imported
when a store is made, not by the launcher.
"""
from __future__ import annotations

import datetime
from typing import Any

from system.name_resolve import NameResolve


def host_store(name_resolve: NameResolve, key: str, host: str, world_size: int,
               timeout: float) -> Any:
    """Start the store of a ``world_size`` group on ``host`` and publish its address under
    ``key``; the caller keeps the returned store alive as long as the group lives."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    name_resolve.add(key, f"{host}:{store.port}", replace=True)
    return store


def join_store(address: str, world_size: int, timeout: float) -> Any:
    """Connect to the store at ``host:port``. Each rank needs its own client: one blocked in
    ``wait`` holds its connection and would starve another rank's rendezvous."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))


def lookup_store(name_resolve: NameResolve, key: str, world_size: int, timeout: float) -> Any:
    """Wait for the address published under ``key`` and connect to it."""
    return join_store(name_resolve.wait(key, timeout), world_size, timeout)
