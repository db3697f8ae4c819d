"""Capture modes (crabd.capture): the plan mapping and the setting. (The
`full` mode's tar copy is gone: full is crabd's FS_PROC capture at every turn,
tests/integration/crabd/daemon/test_capture_modes.py; the tar's size for the benchmark's
naive figure is tests/unit/bench/test_recovery_summary.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from crabd.capture import FS_ONLY_REASON, FULL_REASON, MODES, apply_mode
from crabd.settings import Settings, SettingsError, load_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("kind", ["SKIP", "FS", "FS_PROC"])
def test_auto_keeps_the_classifiers_plan(kind):
    assert apply_mode(kind, ["r"], "auto") == (kind, ["r"])


@pytest.mark.parametrize("kind,want", [("SKIP", "SKIP"), ("FS", "FS"), ("FS_PROC", "FS")])
def test_fs_only_never_dumps_processes(kind, want):
    got, reasons = apply_mode(kind, ["r"], "fs-only")
    assert got == want
    assert (FS_ONLY_REASON in reasons) == (kind == "FS_PROC")
    assert reasons[0] == "r"


@pytest.mark.parametrize("kind", ["SKIP", "FS", "FS_PROC"])
def test_full_dumps_everything_every_turn(kind):
    assert apply_mode(kind, [], "full") == ("FS_PROC", [FULL_REASON])


def test_unknown_mode_is_an_error_naming_the_modes():
    with pytest.raises(ValueError, match="fs-only"):
        apply_mode("FS", [], "everything")


def test_the_setting(tmp_path):
    assert Settings().capture == "auto" and set(MODES) == {"auto", "fs-only", "full"}
    assert "capture = " in (ROOT / "systemd" / "config.toml.sample").read_text()
    p = tmp_path / "c.toml"
    p.write_text('capture = "full"\n')
    assert load_settings(p).capture == "full"
    assert Settings().with_overrides(capture="fs-only").capture == "fs-only"
    with pytest.raises(SettingsError) as e:
        Settings().with_overrides(capture="everything")
    assert e.value.field == "capture"


def test_late_bytes_are_signed(tmp_path):
    """A checkpoint's bytes, filled in after its commit, keep its digest valid;
    a later change behind crabd's back is still caught."""
    import sqlite3

    from crabd.errors import NotFound
    from crabd.store import CheckpointRow, IntegrityError, SandboxRow, Store
    s = Store(tmp_path)
    try:
        s.add_sandbox(SandboxRow(id="sb-1", name="one", image="img", fs_key="root-1", lineage="sb-1"))
        s.add_checkpoint(CheckpointRow(id="sb-1-1", sandbox_id="sb-1", seq=1, parent=None, branch=0, turn=1,
                                       plan="FS", fs_snapshot="snap-1"))
        s.commit_checkpoint("sb-1-1", durations={"total": 0.1})
        row = s.set_checkpoint_bytes("sb-1-1", 12345, {"size": 0.5})
        assert row.bytes == 12345 and row.durations == {"total": 0.1, "size": 0.5}
        got = s.get_checkpoint("sb-1-1", verify=True)
        assert got.bytes == 12345 and got.digest == row.digest
        db = sqlite3.connect(tmp_path / "crabd.db")
        db.execute("UPDATE checkpoints SET bytes=1 WHERE id='sb-1-1'")
        db.commit()
        with pytest.raises(IntegrityError):
            s.get_checkpoint("sb-1-1", verify=True)
        with pytest.raises(NotFound):
            s.set_checkpoint_bytes("sb-1-9", 1)
    finally:
        s.close()
