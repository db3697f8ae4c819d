"""The daemon answers within a second of a (re)start, and the CLI starts
quickly, only while the heavy modules stay out of their start (issue 16):
FastAPI and what it pulls (starlette, opentelemetry), the Docker API, the
registry code (httpx), the operator view and rich are imported when
something needs them. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

HEAVY = ("fastapi", "starlette", "opentelemetry", "httpx", "rich", "crabd.api", "crabd.api_effects",
         "crabd.dockerapi", "crabd.remote", "crabd.ui")


def loaded_after(code: str) -> set[str]:
    """The modules loaded after running `code` in a fresh interpreter."""
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return set(json.loads(r.stdout.splitlines()[-1]))


def heavy(mods: set[str], allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(m for m in mods for h in HEAVY
                  if (m == h or m.startswith(h + ".")) and not any(m == a or m.startswith(a + ".") for a in allowed))


@pytest.mark.parametrize("code", [
    "import crabd.serve",                      # what `crabd serve` imports before it binds its socket
    "import crabd.cli",                        # every `crabd` command, `crabd --help`
    "import crabd.cli, crabd.settings, crabd.serve, crabd.daemon",   # `crabd serve` up to its health answer
])
def test_start_imports_nothing_heavy(code: str) -> None:
    assert heavy(loaded_after(code)) == []


def test_the_daemon_still_gets_its_api() -> None:
    # the guard above is not vacuous: building the app does import them
    mods = loaded_after("from crabd.serve import _build_app; import crabd.api")
    assert "fastapi" in mods and "crabd.api" in mods


def test_remote_layer_prefix_is_the_registry_codes() -> None:
    from crabd.daemon.names import REMOTE_LAYER
    from crabd.remote.transfer import IMPORTED_PREFIX
    assert REMOTE_LAYER == IMPORTED_PREFIX
