"""`make demo`'s script run for real (scripts/demo.py, as `make demo` runs it
after setup): the dev-server trace through a crabd daemon with the real BPF
inspector, a mid-turn kill -9 of every process in the sandbox, crabd's
automatic rollback with the server restored, the same crash chat-only, the
table, and nothing left behind. The demo's state is a temp dir; its image is
imported from the tests' image cache ($CRABD_TEST_STATE_DIR, filled by the
`debian_image` fixture), so no debootstrap runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from crabd.runtime import Runtime
from crabd.testing import cleanup_state_dir

import pytest

pytestmark = pytest.mark.needs("runc", "criu", "bpf", "busybox", "debian-py")

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "scripts" / "demo.py"


def _serving(state: Path) -> list[int]:
    """Pids of `crabd serve` processes on `state` (none must outlive the demo)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and str(state).encode() in argv:
            out.append(int(p.name))
    return out


def test_demo_crabd_recovers_the_dev_server_trace(runtime, debian_image):
    state = Path(tempfile.mkdtemp(prefix="crabd-demo-test-", dir="/var/tmp"))
    env = {**os.environ, "CRABD_DEMO_STATE": str(state), "COLUMNS": "120",
           "CRABD_TEST_STATE_DIR": str(runtime.images.root.parent)}
    env.pop("CRABD_DEMO_TRACE", None)
    env.pop("CRABD_DEMO_CRASH_TURN", None)
    try:
        p = subprocess.run([sys.executable, str(DEMO), "--json"], env=env, capture_output=True, text=True,
                           timeout=400)
        log = f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-6000:]}"
        assert p.returncode == 0, log
        assert "debootstrap" not in p.stderr, "the demo built its image instead of importing the test cache\n" + log
        text = p.stderr
        # the narrative: the crash, crabd's own rollback, the table's rows
        assert "crash in turn" in text and "crabd rolled it back on its own" in text, log
        assert "running again with their memory: python3 server.py" in text, log
        rows = [line.split() for line in text.splitlines()]
        crabd_row = next((r for r in rows if r[:1] == ["crabd"] and "yes" in r), None)
        chat_row = next((r for r in rows if r[:1] == ["chat-only"]), None)
        assert crabd_row is not None and chat_row is not None, "no table rows for crabd and chat-only\n" + log
        assert crabd_row.count("yes") == 2, log  # checks pass, digest matches

        res = json.loads(p.stdout.strip().splitlines()[-1])
        assert res["trace"] == "dev-server"
        assert len(res["reference"]["digest"]) == 64 and "python3 server.py" in res["reference"]["processes"]
        assert 8 <= res["crash_turn"] <= 14, res  # second half, not the last of 15 turns
        crabd, chat = res["methods"]["crabd"], res["methods"]["chat-only"]
        assert crabd["correct"] and crabd["checks_pass"] and crabd["digest_matches"], crabd
        assert crabd["lost"] == [], crabd
        assert "python3 server.py" in crabd["processes"], crabd
        assert crabd["recovered"].startswith("files + ") and "recovery_ms" in crabd, crabd
        assert crabd["bytes"] > 0, crabd
        # chat-only as measured: its fresh sandbox cannot have the server that turn 2 started
        assert "python3 server.py" not in chat["processes"], chat
        assert chat["bytes"] == 0 and "recovery_ms" in chat, chat
        assert any(x.startswith("processes: ") for x in chat["lost"]), chat

        # cleaned up: no sandbox, no daemon
        assert Runtime(state).list() == [], "the demo left sandboxes behind"
        assert _serving(state) == [], "the demo left its daemon running"
        assert "cleaned up: sandboxes deleted, daemon stopped" in text, log
    finally:
        for pid in _serving(state):
            os.kill(pid, 9)
        rt = Runtime(state)
        for sb in rt.list():
            rt.destroy(sb.id)
        cleanup_state_dir(state)


def test_demo_names_the_wrong_field_of_a_malformed_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad", "turns": [{"llm_wait_ms": 10}]}))
    state = tmp_path / "state"
    p = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CRABD_DEMO_TRACE": str(bad), "CRABD_DEMO_STATE": str(state)})
    assert p.returncode != 0
    assert "turns.0.run" in p.stderr, p.stderr
    assert not state.exists(), "nothing is set up for a trace that does not load"
