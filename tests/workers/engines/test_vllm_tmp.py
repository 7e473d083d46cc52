"""vLLM's temporary files and sockets go to a directory of the process's own, removed at its
exit (a real engine's are checked where the OpenAI tests build one in processes of its own)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from tests.helpers import REPO
from workers.engines.vllm_tmp import RPC_VARIABLE, _remove, engine_temp_dir, private_dir


def test_while_an_engine_is_built_temporary_files_go_to_the_private_directory():
    env: dict[str, str] = {"TMPDIR": "/somewhere"}
    outside = tempfile.gettempdir()
    with engine_temp_dir(env) as path:
        assert tempfile.gettempdir() == path == env["TMPDIR"] == env[RPC_VARIABLE]
        assert os.path.dirname(path) == outside and os.path.isdir(path)
        assert len(os.path.join(path, "0" * 36)) < 107  # vLLM's socket names: uuid4
        with tempfile.NamedTemporaryFile() as f:
            assert os.path.dirname(f.name) == path
    assert tempfile.gettempdir() == outside and env["TMPDIR"] == "/somewhere"
    assert env[RPC_VARIABLE] == path  # for good: vLLM may have frozen its reading of it
    with engine_temp_dir(env) as again:
        assert again == path == private_dir()


def test_a_socket_directory_the_user_named_is_kept(tmp_path):
    env = {RPC_VARIABLE: str(tmp_path)}
    with engine_temp_dir(env) as path:
        assert env[RPC_VARIABLE] == str(tmp_path) != path
    assert "TMPDIR" not in env


def test_a_forked_child_uses_a_directory_of_its_own():
    """A warm spare's prepared child (forked) builds its own engine: the parent's directory,
    inherited in the environment, goes when the parent exits."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child reports and leaves without running the test session's atexit)
        try:
            env = {RPC_VARIABLE: private_dir()}
            with engine_temp_dir(env) as path:
                os.write(w, f"{env[RPC_VARIABLE]} {path} {private_dir()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    named, path, again = os.read(r, 4096).decode().split()
    os.close(r)
    os.waitpid(pid, 0)
    assert named == path == again != private_dir()
    _remove(path, os.getpid())


def test_only_the_process_that_made_it_removes_it(tmp_path):
    path = tmp_path / "rpc"
    path.mkdir()
    _remove(str(path), os.getpid() + 1)  # a forked child exiting through atexit
    assert path.is_dir()
    _remove(str(path), os.getpid())
    assert not path.exists()


def test_the_directory_goes_when_the_process_exits():
    code = ("import os, socket, tempfile; from workers.engines.vllm_tmp import engine_temp_dir\n"
            "with engine_temp_dir() as d:\n"
            "    s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(d, 'engine'))\n"
            "    tempfile.mkstemp(); print(d)\n"
            "    import multiprocessing.util; multiprocessing.util.get_temp_dir()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    path = out.stdout.strip()
    assert "Traceback" not in out.stderr, out.stderr  # (multiprocessing's clean-up ran first)
    assert path.startswith(tempfile.gettempdir()) and os.path.basename(path).startswith("rlsys")
    assert not os.path.exists(path)


def test_directories_whose_owner_died_are_removed(tmp_path, monkeypatch):
    """A warm spare's prepared engine is SIGKILLed: its directory stayed in /tmp. A directory
    goes once nobody holds its lock (a pid says nothing across PID namespaces)."""
    import fcntl

    from workers.engines import vllm_tmp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(vllm_tmp, "_made", {})
    mine = f"{vllm_tmp.PREFIX}{vllm_tmp._host()}-"
    dead, alive, making, other_host = (tmp_path / f"{mine}1-abc", tmp_path / f"{mine}2-def",
                                       tmp_path / f"{mine}3-ghi",
                                       tmp_path / f"{vllm_tmp.PREFIX}00000000-4-jkl")
    for d in (dead, alive, making, other_host):
        d.mkdir()
    for d in (dead, alive, other_host):
        (d / vllm_tmp.LOCK).touch()
    holder = subprocess.Popen(  # a live owner, in another process
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
         str(alive / vllm_tmp.LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        path = private_dir()
        try:
            assert os.path.basename(path).startswith(f"{mine}{os.getpid()}-")
            assert not dead.exists() and alive.exists() and making.exists()
            assert other_host.exists()
            with open(os.path.join(path, vllm_tmp.LOCK)) as f:  # this process holds its own
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    raise AssertionError("the lock was free")
                except BlockingIOError:
                    pass
        finally:
            _remove(path, os.getpid())
    finally:
        holder.kill()
        holder.wait()
