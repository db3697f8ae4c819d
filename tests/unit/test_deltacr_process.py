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
