"""The daemon serves while its BPF inspector compiles (issue 16: a restart
served nothing for ~9 s, a minute under load). Turns that end before the
inspector is ready were not observed: they are saved whole (FS_PROC) and say
why; the first turn of a sandbox after the load is too (its record began in
the middle); then plans are exact again. CRABD_CHAOS=inspector_load holds the
load for CRABD_CHAOS_SLEEP seconds so that the test does not race the compiler."""

from __future__ import annotations

import time

import tempfile
from pathlib import Path

from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, wait_until

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox")


def test_serving_while_the_inspector_loads(runtime, busybox_image):
    state = Path(tempfile.mkdtemp(prefix="crabd-test-", dir="/var/tmp"))
    Runtime(state).images.import_path(runtime.images.get(busybox_image).path, "busybox")
    d = DaemonHandle(state, env={"CRABD_CHAOS": "inspector_load", "CRABD_CHAOS_SLEEP": "20"})
    t0 = time.monotonic()
    d.start(wait_inspector=False)
    try:
        c = d.client()
        h = c.health()
        assert h["inspector"] == "loading" and h["inspector_ready"] is False, h
        served_s = time.monotonic() - t0
        sid = c.create_sandbox("busybox")["id"]
        r = c.exec(sid, "true")
        assert r["plan"] == "FS_PROC", r
        assert any("loading" in x for x in r["reasons"]), r["reasons"]
        wait_until(lambda: c.health()["inspector_ready"], "the inspector loaded", 240)
        assert c.health()["inspector"].startswith("bpf")
        first = c.exec(sid, "true")
        assert first["plan"] == "FS_PROC" and any("late start" in x for x in first["reasons"]), first
        assert c.exec(sid, "true")["plan"] == "SKIP"
        # a sandbox made after the load is watched from its start
        sid2 = c.create_sandbox("busybox")["id"]
        assert c.exec(sid2, "true")["plan"] == "SKIP"
        assert served_s < 20, f"served {served_s:.1f} s after start, not before the held load ended"
    finally:
        d.shutdown()
        cleanup_state_dir(state)
