"""The shipped systemd files: `systemd-analyze verify` accepts crabd.service,
`systemd-tmpfiles` applies crabd.conf, and the unit keeps the properties
crabd relies on (sandboxes outlive the daemon, no private mount namespace).

Requires: systemd-analyze and systemd-tmpfiles (Debian package `systemd`;
PID 1 need not be systemd). A missing tool fails the test with that fix,
like every integration test here: a broken host must not pass as green.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("systemd")

ROOT = Path(__file__).resolve().parents[3]
UNIT = ROOT / "systemd" / "crabd.service"
TMPFILES = ROOT / "systemd" / "crabd.conf"
SHIPPED_EXEC = "/usr/local/bin/crabd"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} not found: install the Debian package `systemd` "
                    f"(apt-get install systemd; it provides {tool} and works without systemd as PID 1)",
                    pytrace=False)
    return path


def crabd_binary() -> Path:
    """The crabd console script of the interpreter running the tests."""
    exe = Path(sys.executable).parent / "crabd"
    if not exe.exists():
        pytest.fail(f"{exe} missing: `pip install -e .` into this venv first", pytrace=False)
    return exe


def service_section() -> configparser.SectionProxy:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]  # unit keys are case-sensitive
    cp.read_string(UNIT.read_text())
    return cp["Service"]


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    analyze = need("systemd-analyze")
    text = UNIT.read_text()
    assert f"ExecStart={SHIPPED_EXEC} serve --config /etc/crabd/config.toml" in text
    # verify checks that ExecStart's binary exists: point it at this venv's
    # crabd, the substitution install scripts make for a non-default path.
    unit = tmp_path / "crabd.service"
    unit.write_text(text.replace(f"ExecStart={SHIPPED_EXEC} ", f"ExecStart={crabd_binary()} "))
    r = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"systemd-analyze verify failed:\n{out}"
    # Unknown or misspelt keys are only warnings with exit 0: refuse them too.
    ours = [line for line in out.splitlines() if "crabd.service" in line]
    assert ours == [], "systemd-analyze verify warned about crabd.service:\n" + "\n".join(ours)


def test_unit_keeps_sandboxes_alive_and_mounts_shared():
    s = service_section()
    assert s["Type"] == "notify"
    assert s["KillMode"] == "process"  # stop/restart kills crabd, not the sandboxes
    assert s["Delegate"] == "yes"
    assert s["Restart"] == "always"
    assert s["TasksMax"] == "infinity"
    isolating = {"PrivateTmp", "ProtectSystem", "ProtectHome", "PrivateMounts", "PrivateDevices",
                 "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem", "MountFlags",
                 "ProtectKernelModules", "ProtectControlGroups", "RootDirectory", "RootImage"}
    assert isolating.isdisjoint(s.keys()), f"mount-isolating settings in the unit: {isolating & set(s.keys())}"


def test_unit_execstart_matches_the_cli():
    """The ExecStart arguments exist on `crabd serve`."""
    r = subprocess.run([str(crabd_binary()), "serve", "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "--config" in r.stdout


def test_tmpfiles_creates_the_directories(tmp_path):
    tmpfiles = need("systemd-tmpfiles")
    r = subprocess.run([tmpfiles, "--create", f"--root={tmp_path}", str(TMPFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"systemd-tmpfiles failed:\n{r.stdout}{r.stderr}"
    run, state = tmp_path / "run" / "crabd", tmp_path / "var" / "lib" / "crabd"
    assert run.is_dir() and state.is_dir()
    assert run.stat().st_mode & 0o7777 == 0o711
    assert state.stat().st_mode & 0o7777 == 0o700
    assert (run.stat().st_uid, state.stat().st_uid) == (0, 0)
