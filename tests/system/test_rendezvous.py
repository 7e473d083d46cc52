"""TCPStores of torch.distributed groups: bound to one interface, keys under a secret prefix."""
from __future__ import annotations

import socket
import threading

import pytest
import torch
import torch.distributed as dist

from system.name_resolve import FileNameResolve
from system.rendezvous import host_store, lookup_store, join_store, store_prefix
from system.wire import Codec, new_secret


def _connects(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def test_prefix_is_secret_and_per_group():
    a, b = Codec(new_secret()), Codec(new_secret())
    assert store_prefix(a, "g1") == store_prefix(Codec(a._secret), "g1")
    assert len({store_prefix(a, "g1"), store_prefix(a, "g2"), store_prefix(b, "g1")}) == 3


def test_store_binds_to_the_interface_and_keys_carry_the_prefix(tmp_path):
    nr = FileNameResolve(str(tmp_path), secret=new_secret())
    prefix = store_prefix(Codec(new_secret()), "weights")
    store = host_store(nr, "t/store", "127.0.0.1", 1, 30, prefix)
    host, port = nr.get("t/store").rsplit(":", 1)
    assert host == "127.0.0.1"
    assert _connects("127.0.0.1", int(port))
    assert not _connects("127.0.0.2", int(port))  # loopback too, but not the bound address
    store.set("rank_0", b"addr")
    outsider = dist.TCPStore("127.0.0.1", int(port), 1, is_master=False)
    assert outsider.list_keys() == [f"{prefix}/rank_0"]  # listing reveals it (see the notes)
    assert not outsider.check(["rank_0"])                 # but no name can be guessed
    member = join_store(nr.get("t/store"), 1, 30, prefix)
    assert member.get("rank_0") == b"addr"


def test_a_gloo_group_forms_over_the_prefixed_store(tmp_path):
    nr = FileNameResolve(str(tmp_path), secret=new_secret())
    prefix = store_prefix(Codec(new_secret()), "smoke")
    store = host_store(nr, "t/store", "127.0.0.1", 2, 30, prefix)
    out: dict[int, float] = {}

    def rank(r: int) -> None:
        s = store if r == 0 else lookup_store(nr, "t/store", 2, 30, prefix)
        pg = dist.ProcessGroupGloo(s, r, 2)
        t = torch.full((4,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = float(t[0])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == {0: 3.0, 1: 3.0}


def test_an_unknown_host_fails_clearly(tmp_path):
    with pytest.raises(OSError):
        host_store(FileNameResolve(str(tmp_path), secret=new_secret()), "t/store", "no-such-host.invalid", 1, 5, "p")
