"""Fixtures of the Docker API tests: a private plain dockerd (the baseline
of the mini-swe-agent test, and the local engine `docker pull` imports from)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from crabd.testing import wait_until


@pytest.fixture
def plain_dockerd(runtime, debian_image):
    """A private dockerd (`--iptables=false --bridge=none`) whose data root is
    cached in the test state dir with debian-py imported (~15 s, once per
    host); one user at a time (flock). Yields its socket."""
    root = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
    lock = open(root / "dockerd.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    run = Path(tempfile.mkdtemp(prefix="crabd-test-dockerd-", dir="/var/tmp"))
    sock = run / "docker.sock"
    cli = ["docker", "-H", f"unix://{sock}"]
    with open(run / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none", "--data-root", str(root / "dockerd"),
                                 "--exec-root", str(run / "exec"), "--pidfile", str(run / "dockerd.pid"),
                                 "-H", f"unix://{sock}"], stdout=log, stderr=log, start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is not None or (sock.exists() and subprocess.run(
            [*cli, "version"], capture_output=True, timeout=30).returncode == 0), "dockerd answering", timeout=120)
        assert proc.poll() is None, (run / "dockerd.log").read_text()[-2000:]
        if subprocess.run([*cli, "image", "inspect", debian_image], capture_output=True, timeout=60).returncode:
            tar = subprocess.Popen(["tar", "-C", runtime.images.get(debian_image).path, "-c", "."],
                                   stdout=subprocess.PIPE)
            subprocess.run([*cli, "import", "-", debian_image], stdin=tar.stdout, capture_output=True, timeout=600,
                           check=True)
            assert tar.wait(60) == 0
        yield sock
    finally:
        if proc.poll() is None:
            ids = subprocess.run([*cli, "ps", "-aq"], capture_output=True, text=True, timeout=60).stdout.split()
            if ids:
                subprocess.run([*cli, "rm", "-f", *ids], capture_output=True, timeout=120)
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        subprocess.run(["umount", "-R", "-l", str(run / "exec")], capture_output=True, timeout=60)
        shutil.rmtree(run, ignore_errors=True)
        lock.close()
