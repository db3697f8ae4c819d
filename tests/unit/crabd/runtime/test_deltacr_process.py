"""crabd.runtime.process: the parts that run without root."""

import os
import subprocess
import sys

import pytest

from crabd.errors import CommandFailed, FailedPrecondition
from crabd.runtime.process import CheckpointableRunner, _check_tree


def test_runc_create_output_goes_to_the_log_and_the_init_gets_a_pipe(tmp_path):
    # A stand-in for `runc create`: prints, leaves a child holding its stdout
    # (the sandbox init), exits.
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\necho created\nsleep 5 &\nls -l /proc/$!/fd/1 > %s/fd1\necho $! > %s/child\nexit 0\n"
                    % (tmp_path, tmp_path))
    fake.chmod(0o755)
    log = tmp_path / "init.log"
    res = CheckpointableRunner().run([str(fake), "create", "x"], timeout=10, log=str(log))
    child = int((tmp_path / "child").read_text())
    os.kill(child, 0)  # still holding the pipe: the runner did not wait for it
    os.kill(child, 9)
    assert res.returncode == 0 and log.read_text() == "created\n"
    assert "pipe:" in (tmp_path / "fd1").read_text()


def test_runc_create_failure_carries_its_output(tmp_path):
    fake = tmp_path / "runc"
    fake.write_text("#!/bin/sh\necho 'container exists' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(CommandFailed, match="container exists"):
        CheckpointableRunner().run([str(fake), "create", "x"], timeout=10, log=str(tmp_path / "l"))


def test_other_commands_run_as_usual():
    res = CheckpointableRunner().run(["/bin/echo", "hi"], timeout=10)
    assert res.stdout == b"hi\n"


def test_check_tree_accepts_descendants_and_names_strangers(tmp_path):
    class Sb:
        id = "sb-test"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        procs = tmp_path / "cgroup.procs"
        procs.write_text(f"{os.getpid()}\n{child.pid}\n")
        _check_tree(Sb(), procs, os.getpid())           # init + its child: fine
        procs.write_text(f"{child.pid}\n{os.getppid()}\n")
        with pytest.raises(FailedPrecondition, match=str(os.getppid())):
            _check_tree(Sb(), procs, os.getpid())        # our parent is not our descendant
    finally:
        child.kill()
        child.wait()


def test_tcp_table_connected_counts_held_connections_only():
    from crabd.runtime.process import tcp_table_connected
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    listen = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0\n"
    tw = "   1: 0100007F:1F90 0100007F:D0A2 06 00000000:00000000 03:00000A1B 00000000     0        0 0 3 0\n"
    est = "   2: 0100007F:1F90 0100007F:D0A4 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0\n"
    assert not tcp_table_connected(head + listen + tw)  # TIME_WAIT belongs to no process: nothing to dump
    assert tcp_table_connected(head + listen + est)
    assert not tcp_table_connected(head)
