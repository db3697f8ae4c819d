"""Fixtures of the runtime's integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def full_capture(start_daemon, tmp_path):
    """A client of a daemon that checkpoints files and processes every turn
    (capture full, /proc inspector) and a new busybox sandbox's id."""
    cfg = tmp_path / "config.toml"
    cfg.write_text('capture = "full"\n')
    c = start_daemon(args=["--config", str(cfg)], env={"CRABD_INSPECTOR": "proc"}).client()
    return c, c.create_sandbox("busybox")["id"]
