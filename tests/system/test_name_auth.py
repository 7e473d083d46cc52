"""Name resolution against another user of the same file root or Redis: entries not written with
the trial's secret are refused (read as absent, counted, logged once), and each user's entries
live in a namespace of their own that nobody else owns."""
from __future__ import annotations

import json
import logging
import os
import stat
import time

import pytest

from system.errors import NameEntryNotFound, UnsafeFileError
from system.name_auth import EntrySealer
from system.name_resolve import FileNameResolve, RedisNameResolve
from system.wire import new_secret

SECRET = new_secret()
OTHER_UID = 65534  # nobody
as_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")


def _entry(nr: FileNameResolve, key: str) -> str:
    return os.path.join(nr.root, *key.split("/"), "ENTRY")


def _poison(path: str, value: str) -> None:
    with open(path, "w") as f:
        json.dump({"value": value, "expires": None}, f)


def _assert_refused(nr, key: str) -> None:
    with pytest.raises(NameEntryNotFound):
        nr.get(key)
    with pytest.raises(NameEntryNotFound):
        nr.wait(key, timeout=0.1)
    assert key not in nr.find_subtree(key.rsplit("/", 1)[0])
    assert key not in nr.get_subtree(key.rsplit("/", 1)[0])


def test_sealed_values_round_trip_and_bind_the_key():
    s = EntrySealer(SECRET)
    stored = s.seal("e/t/worker/a", "tcp://10.0.0.1:5000")
    assert stored.startswith("v1:") and stored.endswith(":tcp://10.0.0.1:5000")
    assert s.open("e/t/worker/a", stored) == "tcp://10.0.0.1:5000"
    assert s.open("e/t/worker/b", stored) is None  # copied to another key
    assert EntrySealer(new_secret()).open("e/t/worker/a", stored) is None  # another secret
    assert s.open("e/t/worker/a", stored.replace("5000", "5001")) is None  # altered value
    for junk in ("", "v1:", "v1:zz:x", "tcp://evil:1", "v1:" + "é" * 64 + ":x"):
        assert s.open("e/t/worker/a", junk) is None
    assert s.refused == 7  # the other-secret sealer counts its own


@pytest.mark.parametrize("poison", ["plain", "other-secret", "altered", "moved"])
def test_poisoned_file_entry_is_refused(tmp_path, caplog, poison):
    nr = FileNameResolve(str(tmp_path / "nr"), secret=SECRET)
    key = "e/t/worker/master/0"
    nr.add(key, "tcp://127.0.0.1:5000")
    nr.add("e/t/worker/model/0", "tcp://127.0.0.1:6000")
    with open(_entry(nr, key)) as f:
        good = json.load(f)["value"]
    forged = {"plain": "tcp://evil:1",
              "other-secret": EntrySealer(new_secret()).seal(key, "tcp://evil:1"),
              "altered": good.replace("5000", "5999"),
              "moved": EntrySealer(SECRET).seal("e/t/worker/model/0", "tcp://evil:1")}[poison]
    _poison(_entry(nr, key), forged)
    with caplog.at_level(logging.WARNING, logger="name_resolve"):
        _assert_refused(nr, key)
        _assert_refused(nr, key)
    assert nr.refused >= 8
    warnings = [r for r in caplog.records if "failed authentication" in r.getMessage()]
    assert len(warnings) == 1 and key in warnings[0].getMessage()  # logged once
    assert nr.get("e/t/worker/model/0") == "tcp://127.0.0.1:6000"  # the rest still reads
    nr.add(key, "tcp://127.0.0.1:5001")  # a forged entry does not block an exclusive add
    assert nr.get(key) == "tcp://127.0.0.1:5001"
    nr.close()


def test_file_entries_are_private(tmp_path):
    nr = FileNameResolve(str(tmp_path / "nr"), secret=SECRET)
    nr.add("e/t/k", "v")
    assert stat.S_IMODE(os.stat(nr.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(_entry(nr, "e/t/k")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "nr").st_mode) == 0o1777  # shared, like /tmp
    assert nr.root == str(tmp_path / "nr" / str(os.getuid()))


@as_root
def test_a_shared_root_others_could_rename_entries_in_is_refused(tmp_path):
    """Another user's shared root without the sticky bit (they could move a user's entries
    away), or a link in its place, is refused; a sticky one, or one of ours, is used."""
    from system.errors import UnsafeFileError

    root = tmp_path / "nr"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match="sticky bit"):
        FileNameResolve(str(root), secret=SECRET)
    os.chmod(root, 0o1777)
    FileNameResolve(str(root), secret=SECRET).close()
    os.symlink(root, tmp_path / "link")
    with pytest.raises(UnsafeFileError, match="link"):
        FileNameResolve(str(tmp_path / "link"), secret=SECRET)


@as_root
def test_users_have_separate_file_namespaces(tmp_path):
    """Another user runs the same exp/trial under the same root: neither sees nor deletes the
    other's keys."""
    root = str(tmp_path / "nr")
    mine = FileNameResolve(root, secret=SECRET)
    mine.add("e/t/worker/master/0", "tcp://me:1")
    theirs = os.path.join(root, str(OTHER_UID), "e", "t", "worker", "master", "0")
    os.makedirs(theirs)
    _poison(os.path.join(theirs, "ENTRY"), "tcp://them:1")
    for dirpath, _dirs, files in os.walk(os.path.join(root, str(OTHER_UID))):
        os.chown(dirpath, OTHER_UID, OTHER_UID)
        for f in files:
            os.chown(os.path.join(dirpath, f), OTHER_UID, OTHER_UID)
    assert mine.get_subtree("e/t") == {"e/t/worker/master/0": "tcp://me:1"}
    assert mine.clear_subtree("e/t") == 1
    assert os.path.exists(os.path.join(theirs, "ENTRY"))  # theirs is untouched
    assert mine.refused == 0  # their entries were never even read


@as_root
def test_namespace_owned_by_someone_else_is_refused(tmp_path):
    root = tmp_path / "nr"
    FileNameResolve(str(root), secret=SECRET).close()
    os.chown(root / str(os.getuid()), OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"owned by uid {OTHER_UID}"):
        FileNameResolve(str(root), secret=SECRET)


def test_namespace_that_is_a_link_is_refused_and_a_loose_one_tightened(tmp_path):
    root = tmp_path / "nr"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / str(os.getuid()))
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        FileNameResolve(str(root), secret=SECRET)
    os.unlink(root / str(os.getuid()))
    os.mkdir(root / str(os.getuid()), 0o755)
    os.chmod(root / str(os.getuid()), 0o755)
    FileNameResolve(str(root), secret=SECRET).close()
    assert stat.S_IMODE(os.stat(root / str(os.getuid())).st_mode) == 0o700


@pytest.fixture
def redis_nr(redis_server):
    import redis

    host, port = redis_server
    ns = f"t{time.time_ns()}"
    nr = RedisNameResolve(host, port, namespace=ns, secret=SECRET)
    raw = redis.Redis(host=host, port=port, decode_responses=True)
    yield nr, raw, f"{ns}:{os.getuid()}:"
    nr.close()
    raw.close()


@pytest.mark.redis
@pytest.mark.parametrize("poison", ["plain", "other-secret", "altered"])
def test_tampered_redis_entry_is_refused(redis_nr, caplog, poison):
    nr, raw, prefix = redis_nr
    key = "e/t/worker/master/0"
    nr.add(key, "tcp://127.0.0.1:5000")
    good = raw.get(prefix + key)
    assert good.startswith("v1:") and good.endswith("tcp://127.0.0.1:5000")
    forged = {"plain": "tcp://evil:1",
              "other-secret": EntrySealer(new_secret()).seal(key, "tcp://evil:1"),
              "altered": good.replace("5000", "5999")}[poison]
    raw.set(prefix + key, forged)
    with caplog.at_level(logging.WARNING, logger="name_resolve"):
        _assert_refused(nr, key)
        _assert_refused(nr, key)
    assert len([r for r in caplog.records if "failed authentication" in r.getMessage()]) == 1
    assert nr.refused >= 8
    nr.add(key, "tcp://127.0.0.1:5001")  # a forged entry does not block an exclusive add
    assert nr.get(key) == "tcp://127.0.0.1:5001"


@pytest.mark.redis
def test_users_have_separate_redis_namespaces(redis_nr):
    nr, raw, prefix = redis_nr
    nr.add("e/t/worker/master/0", "tcp://me:1")
    assert raw.get(prefix + "e/t/worker/master/0") is not None  # under rlsys-like ns:<uid>:
    other = prefix.replace(f":{os.getuid()}:", f":{OTHER_UID}:")
    raw.set(other + "e/t/worker/master/0", "tcp://them:1")
    assert nr.get_subtree("e/t") == {"e/t/worker/master/0": "tcp://me:1"}
    assert nr.clear_subtree("e/t") == 1
    assert raw.get(other + "e/t/worker/master/0") == "tcp://them:1"
    raw.delete(other + "e/t/worker/master/0")
