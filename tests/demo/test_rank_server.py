"""spawn_world's ranks are forks of one preloaded rank server per calling process
(``hybrid.demo._forked``): a later world forks from the same server, each rank sees the caller's
environment and working directory as they are at its start, and ``HYBRID_FRESH_RANKS=1`` gives
fresh interpreters that compute the same. The deaths and tracebacks ranks report are
``tests/parity/test_never_hangs.py``'s."""

import os

import numpy as np
import pytest

from hybrid.demo import TrainConfig, train_torch
from hybrid.demo import _forked
from hybrid.demo._world import spawn_world


def where_am_i(progress=None):
    """A rank's view: its directory, a variable the caller set late, its parent process."""
    return os.getcwd(), os.environ.get("HYBRID_TEST_MARK"), os.getppid()


def test_ranks_see_the_callers_directory_and_environment_at_their_start(tmp_path, monkeypatch):
    spawn_world(where_am_i, world_size=1)  # the server exists from here on, started before the changes below
    server = _forked._server
    monkeypatch.setenv("HYBRID_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    cwd, mark, parent = spawn_world(where_am_i, world_size=2)
    assert (cwd, mark) == (str(tmp_path), "set after the server started")
    assert _forked._server is server and parent == server.proc.pid  # a fork of the same server


def train_where(config, progress=None):
    """``train_torch``'s losses and the rank's parent process."""
    return train_torch(config).losses, os.getppid()


def test_fresh_interpreters_when_asked_compute_the_same(monkeypatch):
    config = TrainConfig(num_steps=2)
    forked, _ = spawn_world(train_where, config, world_size=1)
    monkeypatch.setenv("HYBRID_FRESH_RANKS", "1")
    fresh, parent = spawn_world(train_where, config, world_size=1)
    assert parent == os.getpid()  # this process's own child
    np.testing.assert_array_equal(forked, fresh)  # same program, same numerics: bit for bit


def test_the_server_ends_when_its_caller_closes_it(monkeypatch):
    """What the caller's exit does (atexit): the server sees its socket end and exits by itself,
    status 0, not killed after the 10 s the caller gives it (the reader thread's pending receive
    holds a socket that is only closed open: it must be shut down). The protocol alone: a server
    without the preloads (``tests/demo/_bare_rank_server.py``), beside this process's own."""
    monkeypatch.setattr(_forked, "SERVER_MODULE", "tests.demo._bare_rank_server")
    monkeypatch.setattr(_forked, "_server", _forked._Server())
    server = _forked._server
    with open(os.devnull, "wb") as null:
        assert _forked.start_rank(b"not a pickle", stderr=null).wait(timeout=60) == 1
    server.close()
    assert server.proc.returncode == 0
    again = _forked._get_server()  # the next rank starts a new server
    assert again is not server and again.alive
    again.close()


def test_a_server_that_cannot_start_leaves_the_ranks_fresh_interpreters(monkeypatch, capfd):
    monkeypatch.setattr(_forked, "SERVER_MODULE", "hybrid.demo._no_such_server")
    monkeypatch.setattr(_forked, "_server", None)
    assert spawn_world(where_am_i, world_size=1)[2] == os.getpid()  # a fresh rank: this process's child
    assert "No module named hybrid.demo._no_such_server" in capfd.readouterr().err  # the server said why


# The child only looks at one descriptor and _exits: none of JAX's threads (if this worker has
# imported it) are needed there.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_a_fork_of_the_caller_holds_no_copy_of_the_servers_socket():
    spawn_world(where_am_i, world_size=1)
    fd = _forked._server.sock.fileno()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the socket is closed, the server forgotten
        try:
            os.fstat(fd)
            os._exit(1)
        except OSError:
            os._exit(0 if _forked._server is None else 2)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert _forked._server.alive  # the parent's is untouched
