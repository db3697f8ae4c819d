"""Crash safety: a commit or checkpoint killed at any step leaves either the new snapshot
complete or no trace of it; gc() removes leftovers; metadata and disk agree after reopen.

A child process runs turns (write files, checkpoint) against a state dir and
is SIGKILLed, either at a named failpoint inside the commit path
(DELTAFS_FAILPOINT, see deltafs.snapshotter._failpoint) or at a random time.
The parent then reopens the state dir and checks every committed snapshot.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import deltafs
from deltafs.testing import Mounter

pytestmark = pytest.mark.needs("btrfs", "overlay")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = r"""
import os, sys, deltafs
state, driver, mnt, mode = sys.argv[1:5]
s = deltafs.open(state, driver=driver, **({"pool_size": 4 << 30} if driver == "btrfs" else {}))
try:
    s.stat("sb")
except deltafs.NotFound:
    s.prepare("sb")
deltafs.mount_all(s.mounts("sb"), mnt)
i = 0
while True:
    i += 1
    for j in range(3):
        with open(f"{mnt}/turn-{i}-{j}", "w") as f:
            f.write(str(i) * 1000)
    with open(f"{mnt}/count", "w") as f:
        f.write(str(i))
    if mode == "commit" and i % 3 == 0:
        # the consuming path: commit a separate active made from the last checkpoint
        parent = [x.name for x in s.walk() if x.kind == "committed"]
        s.prepare(f"c{os.getpid()}-{i}", parent=parent[-1] if parent else None)
        s.commit(f"commit-{os.getpid()}-{i}", f"c{os.getpid()}-{i}")
    if mode == "prepare" and i % 2 == 0:
        parent = [x.name for x in s.walk() if x.kind == "committed"]
        s.prepare(f"fork-{os.getpid()}-{i}", parent=parent[-1] if parent else None)
    s.checkpoint("sb")
    print(i, flush=True)
"""


def open_store(state: str, driver: str):
    if os.geteuid() != 0:
        pytest.fail("deltafs crash tests need root (mounts, btrfs ioctls): run them as root")
    try:
        return deltafs.open(state, driver=driver, **({"pool_size": 4 << 30} if driver == "btrfs" else {}))
    except deltafs.FailedPrecondition as e:
        pytest.fail(f"{driver} driver unavailable: {e}")


def on_disk(s) -> set[str]:
    """Snapshot-named directories on disk (what gc() may have to delete)."""
    if s.driver == "btrfs":
        return {f"snapshots/{n}" for n in os.listdir(s.snapdir)}
    out = set()
    for d in ("l", "a", "tmp", "m"):
        out |= {f"{d}/{n}" for n in os.listdir(os.path.join(s.state_dir, d))}
    return out


def expected_on_disk(s) -> set[str]:
    rows = s.meta.all()
    if s.driver == "btrfs":
        return {f"snapshots/{r.id}" for r in rows if r.kind != "view"}
    out = {f"l/{r.id}" for r in rows if r.kind == "committed"}
    out |= {f"a/{r.id}" for r in rows if r.kind == "active"}
    for r in rows:
        out |= {c for c in r.extra.get("chain", []) if c.startswith("m/")}
    return out


def check_consistent(s, m: Mounter) -> int:
    """Every committed snapshot is complete: count=N and all turn files 1..N with their content."""
    n = 0
    for info in list(s.walk()):
        if info.kind != "committed":
            continue
        v = m.mount(s.view("check", info.name))
        try:
            with open(f"{v}/count") as f:
                count = int(f.read())
            for i in range(1, count + 1):
                for j in range(3):
                    with open(f"{v}/turn-{i}-{j}") as f:
                        assert f.read() == str(i) * 1000, (info.name, i, j)
            n += 1
        finally:
            m.unmount(v)
            s.remove("check")
    return n


def run_child(state: str, driver: str, mnt: str, mode: str, failpoint: str | None, kill_after: float | None) -> int:
    env = dict(os.environ, PYTHONPATH=ROOT, DELTAFS_FAILPOINT=failpoint or "")
    p = subprocess.Popen([sys.executable, "-c", CHILD, state, driver, mnt, mode], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if kill_after is not None:
            time.sleep(kill_after)
            p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == -signal.SIGKILL, f"child was not killed (rc {p.returncode}): {err[-2000:]}"
    return len(out.split())


FAILPOINTS = {
    # name@n: the n-th time the point is reached (the first turns must succeed
    # so there is something to lose).
    "btrfs": ["btrfs-after-snapshot@4", "btrfs-after-rename@4", "checkpoint-before-commit@3",
              "checkpoint-after-commit@3", "commit-before-commit@2", "prepare-before-commit@3"],
    "overlay": ["overlay-after-copy@3", "overlay-after-rename@3", "checkpoint-before-commit@3",
                "checkpoint-after-commit@3", "commit-before-commit@2", "prepare-before-commit@3",
                "overlay-after-move@2"],
}
CASES = [(d, fp) for d in FAILPOINTS for fp in FAILPOINTS[d]] + [(d, None) for d in FAILPOINTS]


@pytest.mark.parametrize("driver,failpoint", CASES, ids=[f"{d}-{fp or 'random-kills'}" for d, fp in CASES])
def test_killed_commit_leaves_complete_or_nothing(driver, failpoint):
    base = tempfile.mkdtemp(prefix=f"deltafs-crash-{driver}-", dir="/var/tmp")
    state, mnt = os.path.join(base, "state"), os.path.join(base, "mnt")
    os.makedirs(mnt)
    m = Mounter(base)
    point = (failpoint or "").partition("@")[0]
    mode = {"commit-before-commit": "commit", "overlay-after-move": "commit",
            "prepare-before-commit": "prepare"}.get(point, "checkpoint")
    rounds = 1 if failpoint else 4
    rng = random.Random(1234)
    s = None
    try:
        for r in range(rounds):
            run_child(state, driver, mnt, "commit" if r % 2 else mode, failpoint,
                      None if failpoint else rng.uniform(0.3, 1.2))
            deltafs.unmount(mnt, detach=True)  # the child's sandbox mount outlives it
            s = open_store(state, driver)
            s.gc()
            assert on_disk(s) == expected_on_disk(s), "metadata and disk disagree after gc()"
            assert check_consistent(s, m) >= 1
            s.close()
            s = None
        # A fresh process can carry on checkpointing the same active after the crash.
        s = open_store(state, driver)
        t = m.mount(s.mounts("sb"))
        with open(f"{t}/after", "w") as f:
            f.write("x")
        n = s.checkpoint("sb")
        assert any(c.path == b"after" for c in s.diff(s.stat(n).parent, n))
    finally:
        m.cleanup()
        deltafs.unmount(mnt, detach=True)
        if s is not None:
            s.close()
        if driver == "btrfs":
            deltafs.unmount(os.path.join(state, "pool"))
        shutil.rmtree(base, ignore_errors=True)
