"""Name resolution, identical behaviour on the file and redis backends."""
from __future__ import annotations

import os
import threading
import time

import pytest

from system.errors import NameEntryExists, NameEntryNotFound, NameResolveError
from system.name_resolve import Entry, FileNameResolve, RedisNameResolve
from system.wire import new_secret

SECRET = new_secret()


@pytest.fixture(params=["file", pytest.param("redis", marks=pytest.mark.redis)])
def nr(request, tmp_path):
    if request.param == "file":
        backend = FileNameResolve(str(tmp_path / "nr"), secret=SECRET)
    else:
        host, port = request.getfixturevalue("redis_server")
        backend = RedisNameResolve(host, port, namespace=f"t{time.time_ns()}", secret=SECRET)
    yield backend
    backend.close()


def test_add_get_replace(nr):
    nr.add("e/t/a", "1")
    assert nr.get("e/t/a") == "1"
    with pytest.raises(NameEntryExists):
        nr.add("e/t/a", "2")
    nr.add("e/t/a", "2", replace=True)
    assert nr.get("e/t/a") == "2"
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/missing")


def test_prefix_keys_and_subtree(nr):
    nr.add("e/t/worker", "root")
    nr.add("e/t/worker/0", "a")
    nr.add("e/t/worker/1", "b")
    nr.add("e/t/workerX", "not-under")
    nr.add("e/other/worker/0", "c")
    assert nr.find_subtree("e/t/worker") == ["e/t/worker", "e/t/worker/0", "e/t/worker/1"]
    assert nr.get_subtree("e/t/worker/") == {"e/t/worker": "root", "e/t/worker/0": "a",
                                             "e/t/worker/1": "b"}
    assert nr.find_subtree("e/nothing") == []


def test_delete_and_clear(nr):
    nr.add("e/t/x/1", "1")
    nr.add("e/t/x/2", "2")
    nr.add("e/u/x", "keep")
    nr.delete("e/t/x/1")
    with pytest.raises(NameEntryNotFound):
        nr.delete("e/t/x/1")
    assert nr.clear_subtree("e/t") == 1
    assert nr.find_subtree("e/t") == []
    assert nr.get("e/u/x") == "keep"


def test_wait(nr):
    with pytest.raises(NameEntryNotFound):
        nr.wait("e/t/late", timeout=0.2)
    threading.Timer(0.2, nr.add, args=("e/t/late", "here")).start()
    assert nr.wait("e/t/late", timeout=5) == "here"
    told = threading.Event()  # a worker told to stop waits no longer (not the timeout)
    threading.Timer(0.2, told.set).start()
    t0 = time.monotonic()
    with pytest.raises(NameEntryNotFound, match="no longer waited for: stopping"):
        nr.wait("e/t/never", timeout=60, stop=told.is_set)
    assert time.monotonic() - t0 < 5


def test_ttl_expires_without_keepalive(nr):
    nr.add("e/t/hb", "x", keepalive_ttl=1.5)  # (a loaded machine may take a while to read)
    nr.close()  # stop refreshing: the entry must expire by itself
    assert nr.get("e/t/hb") == "x"
    time.sleep(2.0)
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/hb")
    assert nr.find_subtree("e/t") == []
    nr.add("e/t/hb", "again")  # an expired entry does not block a new add
    assert nr.get("e/t/hb") == "again"


def _refreshed_past_its_ttl(nr, key: str, ttl: float) -> None:
    """Until ``key``'s expiry lies past one TTL from this call by more than a read's error
    (redis: whole milliseconds, the reply's delay): a refresh came after the call (a stall
    of the refresher under load delays this, it does not fail it)."""
    first = time.time() + ttl + ttl / 6
    deadline = time.monotonic() + 10 * ttl
    while (nr.read_many([key]).get(key) or Entry("", 0.0)).expires <= first:
        assert time.monotonic() < deadline, f"{key} was not refreshed"
        time.sleep(0.05)


def test_a_released_entry_is_no_longer_refreshed_and_expires(nr):
    nr.add("e/t/alive", "x", keepalive_ttl=0.4)
    nr.add("e/t/hb", "y", keepalive_ttl=1.5)
    nr.release("e/t/alive")  # the other keeps being refreshed by the same client
    assert nr.get("e/t/alive") == "x"
    time.sleep(1.2)
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/alive")
    _refreshed_past_its_ttl(nr, "e/t/hb", 1.5)
    assert nr.get("e/t/hb") == "y"


def test_a_process_keeps_no_refresh_times_of_entries_it_let_go(nr):
    """A long-running process adds and lets go of many keep-alive entries (requests, leases):
    the refresh time it keeps for each (the test of a lost entry) goes with it."""
    for i in range(4):
        nr.add(f"e/t/k/{i}", "x", keepalive_ttl=5)
    nr.add("e/u/k", "x", keepalive_ttl=5)
    for let_go, key in ((nr.delete, "e/t/k/0"), (nr.release, "e/t/k/1"),
                        (nr.forget, "e/t/k/2")):
        let_go(key)
        assert key not in nr._refreshed
    nr.clear_subtree("e/t")
    assert list(nr._refreshed) == ["e/u/k"]


def test_keepalive_keeps_entry(nr):
    nr.add("e/t/hb", "x", keepalive_ttl=0.6)
    _refreshed_past_its_ttl(nr, "e/t/hb", 0.6)
    assert nr.get("e/t/hb") == "x"


def test_bad_keys_rejected(nr):
    for key in ("", "a//b", "a/../b", "a/.hidden"):
        with pytest.raises(NameResolveError):
            nr.add(key, "v")


def test_file_backend_two_instances_share_root(tmp_path):
    a, b = (FileNameResolve(str(tmp_path), secret=SECRET),
            FileNameResolve(str(tmp_path), secret=SECRET))
    a.add("e/t/k", "v")
    assert b.get("e/t/k") == "v"
    with pytest.raises(NameEntryExists):
        b.add("e/t/k", "w")


def test_file_backend_concurrent_exclusive_add(tmp_path):
    """Of many racing ``add(replace=False)``, exactly one wins (exclusive create by link)."""
    wins, losses = [], []

    def attempt(i):
        try:
            FileNameResolve(str(tmp_path), secret=SECRET).add("e/t/leader", str(i))
            wins.append(i)
        except NameEntryExists:
            losses.append(i)

    _in_threads(attempt, 16)
    assert len(wins) == 1 and len(losses) == 15
    assert FileNameResolve(str(tmp_path), secret=SECRET).get("e/t/leader") == str(wins[0])


def test_read_many_gives_live_values_and_expiries(nr):
    nr.add("e/t/hb/0", "a", keepalive_ttl=30)
    nr.add("e/t/hb/1", "b")
    nr.add("e/t/hb/2", "gone", keepalive_ttl=0.1)
    nr.close()  # stop refreshing: hb/2 expires
    time.sleep(0.3)
    before = time.time()
    got = nr.read_many(["e/t/hb/0", "e/t/hb/1", "e/t/hb/2", "e/t/hb/missing"])
    assert set(got) == {"e/t/hb/0", "e/t/hb/1"}
    assert got["e/t/hb/0"].value == "a" and got["e/t/hb/1"] == ("b", None)
    assert before + 25 < got["e/t/hb/0"].expires <= time.time() + 30.5
    assert nr.read_many([]) == {}


def test_a_verified_value_is_checked_again_once_it_changes(nr):
    """The cache of verified values must not let an entry altered in place through."""
    nr.add("e/t/k", "v")
    assert nr.get("e/t/k") == "v" and nr.read_many(["e/t/k"])["e/t/k"].value == "v"
    forged = "v1:" + "0" * 64 + ":evil"
    if isinstance(nr, FileNameResolve):
        with open(nr._path("e/t/k"), "w") as f:
            f.write('{"value": "%s", "expires": null}' % forged)
    else:
        nr._r.set(nr._k("e/t/k"), forged)
    refused = nr.refused
    assert nr.read_many(["e/t/k"]) == {}
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/k")
    assert nr.refused == refused + 2


def test_sibling_keys_added_and_deleted_at_once_never_fail(nr):
    """Two workers restarted together (a lost node): one's key is deleted as the other's is
    written under the same parent. The file backend's delete prunes directories that went
    empty, which removed the one the other was making (FileNotFoundError: the restarted
    worker died as it registered its heartbeat)."""
    errors: list[BaseException] = []

    def churn(index: int) -> None:
        key = f"t/heartbeat/rollout/{index}"
        try:
            for _ in range(300):
                nr.add(key, "1", replace=True)
                nr.delete(key)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    _in_threads(churn, 3)
    assert errors == []


def _in_threads(target, n: int) -> None:
    """``target(i)`` for i in 0..n-1, each in a thread of its own, all at once; wait for all."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _lose_everything(nr) -> None:
    """What a FLUSHALL, an eviction or ``rm -rf`` of the directory does to a trial's entries."""
    if isinstance(nr, FileNameResolve):
        import shutil

        gone = nr.shared + ".gone"  # (moved first: a refresh may write into it meanwhile)
        os.rename(nr.shared, gone)
        shutil.rmtree(gone)
        return
    import redis

    client = redis.Redis(*nr._where.split(":"))
    for key in client.scan_iter(match=nr._ns + "*"):
        client.delete(key)


def test_entries_the_backend_lost_are_added_back(nr):
    """Lost without a server restart (FLUSHALL, an eviction, a stray delete, a deleted
    directory), a process's entries stayed lost but for its keep-alive ones: an RL trial
    then hung, its restarted workers unable to find the master. The keep-alive refresh now
    finds its entry gone and adds back every entry the process holds; the file backend's
    directories come back with their own modes (the shared one 1777, the user's 0700)."""
    import stat

    # refreshed every second: a refresh later than the TTL takes this process for one that
    # stood still, which adds nothing back (a loaded machine may stall the refresher a while)
    nr.add("e/t/hb", "x", keepalive_ttl=3.0)
    nr.add("e/t/addr", "tcp://a")
    nr.add("e/t/req", "1")
    nr.forget("e/t/req")  # another process's to delete once answered: not added back
    _lose_everything(nr)
    deadline = time.monotonic() + 15
    while True:
        try:
            assert nr.get("e/t/addr") == "tcp://a"
            break
        except NameEntryNotFound:
            assert time.monotonic() < deadline, "the lost entry was never added back"
            time.sleep(0.05)
    assert nr.get("e/t/hb") == "x"
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/req")
    assert nr.outage_within(5)  # heartbeats missed meanwhile are no news yet
    if isinstance(nr, FileNameResolve):
        assert stat.S_IMODE(os.stat(nr.shared).st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(nr.root).st_mode) == 0o700


def test_only_entries_that_were_lost_are_counted_as_added_back(nr):
    """"N added back" counted every entry the process held (on Redis: one found as this very
    value counted as a write retried), so a loss of one entry read as a loss of all."""
    nr.add("e/t/kept", "1")
    nr.add("e/t/lost", "2")
    assert nr._delete("e/t/lost")
    assert nr._restore_owned() == 1
    assert nr.get("e/t/lost") == "2" and nr.get("e/t/kept") == "1"
    assert nr._restore_owned() == 0


def test_a_process_that_stood_still_or_is_stopping_adds_nothing_back(nr):
    """A process stopped past its TTL (SIGSTOP, a frozen VM) may have been replaced: the
    controller deleted its keys. When it runs again it must not add its old address back
    over its replacement's registration (its refresh writes the heartbeat again, as it
    always did). Nor does a stopping process add anything back, even after a real loss."""
    nr.add("e/t/hb", "x", keepalive_ttl=0.6)
    nr.add("e/t/addr", "tcp://old")
    with nr._ka_put_lock:  # (no refresh in between: it judges its lateness under this lock)
        nr._refreshed["e/t/hb"] = time.monotonic() - 10  # as if it stood still for 10 s
        for key in ("e/t/hb", "e/t/addr"):  # from the store only, as the controller deletes
            assert nr._delete(key)  # (this process still holds both)
    time.sleep(1.0)  # refreshes find the heartbeat gone, late
    assert nr.get("e/t/hb") == "x"
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/addr")
    nr.stopping(1.0)
    _lose_everything(nr)
    time.sleep(1.0)
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/addr")


def _twin(nr):
    """Another process's client of the same store (same namespace or root, same secret)."""
    if isinstance(nr, FileNameResolve):
        return FileNameResolve(nr.shared, secret=SECRET)
    host, port = nr._where.split(":")
    return RedisNameResolve(host, int(port), namespace=nr._ns.split(":")[0], secret=SECRET)


def test_a_replaced_process_stops_refreshing_its_replacements_heartbeat(nr):
    """A worker that stood still past its TTL (stopped, a frozen VM) is replaced: the new one
    registers the heartbeat under the same key. When the old one runs again, its keep-alive
    refresh wrote its own value over the replacement's at every period, so the key lived on
    while either did: the replacement's death was hidden until the old process was stopped.
    Now the old one, late, finds another process's value there, gives it back and stops
    refreshing that key; the key expires once its holder stops."""
    nr.add("e/t/hb", "old-pid", keepalive_ttl=0.6)
    new = _twin(nr)
    try:
        with nr._ka_put_lock:  # (no refresh in between: it judges its lateness under this lock)
            nr._refreshed["e/t/hb"] = nr._ka_alive = time.monotonic() - 10  # stood still 10 s
            new.add("e/t/hb", "new-pid", replace=True, keepalive_ttl=0.6)  # its replacement
        deadline = time.monotonic() + 10
        while "e/t/hb" in nr._keepalive:
            assert time.monotonic() < deadline, "the old process never let go"
            time.sleep(0.05)
        seen = set()
        deadline = time.monotonic() + 1.2  # several refreshes of the replacement
        while time.monotonic() < deadline:
            seen.add(nr.get("e/t/hb"))
            time.sleep(0.01)
        assert seen == {"new-pid"}
    finally:
        new.close()  # the replacement dies: nothing refreshes its heartbeat any more
    time.sleep(1.0)
    with pytest.raises(NameEntryNotFound):
        nr.get("e/t/hb")


def test_a_process_that_never_stood_still_keeps_its_key_against_a_stale_write(nr):
    """The two may meet: a stale process reads its own value, its replacement registers, then
    the stale one's write lands on top. The replacement, which never stood still, must not take
    that for being replaced (it would stop refreshing its own heartbeat and be judged dead):
    it writes its own back, and only the stale one lets go, at its next refresh."""
    nr.add("e/t/hb", "mine", keepalive_ttl=0.6)
    stale = _twin(nr)
    try:
        stale._put("e/t/hb", stale._sealer.seal("e/t/hb", "stale"), 0.6, True)  # its write
        time.sleep(1.0)  # several refreshes
        assert nr.get("e/t/hb") == "mine" and "e/t/hb" in nr._keepalive
    finally:
        stale.close()


def test_an_outage_past_the_ttl_is_not_standing_still(nr):
    """Refreshes that fail for longer than the TTL (the name service down) do not mark the
    process as one that stood still (and might have been replaced): it never lets its key go
    to a stale process's write after the outage. Marked so, every process of a trial did after
    an outage of 5 s, and one stale write then made a healthy replacement stop refreshing its
    own heartbeat."""
    nr.add("e/t/hb", "mine", keepalive_ttl=0.6)
    real = nr._refresh
    failing = threading.Event()

    def refresh(key, value, ttl):
        if failing.is_set():
            raise NameResolveError("the name service does not answer")
        return real(key, value, ttl)

    nr._refresh = refresh
    failing.set()
    time.sleep(1.5)  # two and a half TTLs of failed refreshes
    failing.clear()
    time.sleep(0.5)
    assert "e/t/hb" not in nr._stood_still
    stale = _twin(nr)
    try:
        stale._put("e/t/hb", stale._sealer.seal("e/t/hb", "stale"), 0.6, True)
        time.sleep(1.0)
        assert nr.get("e/t/hb") == "mine" and "e/t/hb" in nr._keepalive
    finally:
        stale.close()


def test_a_file_backend_on_a_full_file_system_refuses_in_one_line_and_leaves_no_temporary(
        tmp_path):
    """A write that fails (a full disk, a read-only mount) was a raw ``OSError`` (blamed on the
    worker, recovered in vain) and left its temporary file, one more at every refresh."""
    from system.errors import ConfigError, NameServiceRefused
    from tests.helpers import tmpfs

    with tmpfs(str(tmp_path / "fs"), "1m") as fs:
        root = os.path.join(fs, "nr")
        nr = FileNameResolve(root, secret=SECRET)
        try:
            nr.add("e/t/a", "1")
            with open(os.path.join(fs, "filler"), "wb", buffering=0) as f:
                with pytest.raises(OSError):
                    while True:
                        f.write(b"\0" * 65536)
            with pytest.raises(NameServiceRefused) as e:
                nr.add("e/t/b", "2" * 8192)
            assert isinstance(e.value, ConfigError)
            mine = os.path.join(root, str(os.getuid()))  # (each user's entries apart)
            assert str(e.value) == (f"the name-resolution directory {mine} refused a write (No "
                                    "space left on device): make room on its file system, or "
                                    "set name_resolve.file_root")
            left = [n for _, _, files in os.walk(root) for n in files if n.endswith(".tmp")]
            assert left == []
            assert nr.get("e/t/a") == "1"
        finally:
            nr.close()
