"""Where crabd keeps things, and the defaults a user can override.

Every command that touches state takes `--state-dir` (default
/var/lib/crabd, or $CRABD_STATE_DIR) so several crabd instances -- tests
among them -- can run side by side.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_STATE_DIR", "DEFAULT_PREFIX", "state_dir_from_env", "init_binary", "runc_binary", "exec_channel"]

DEFAULT_STATE_DIR = Path("/var/lib/crabd")
# Private prefix written by scripts/setup-host: CRIU 4, crabd-init.
DEFAULT_PREFIX = Path(os.environ.get("CRABD_PREFIX", "/opt/crabd"))


def state_dir_from_env() -> Path:
    return Path(os.environ.get("CRABD_STATE_DIR", str(DEFAULT_STATE_DIR)))


def init_binary() -> Path:
    """crabd's static init, bind-mounted read-only into every sandbox."""
    return Path(os.environ.get("CRABD_INIT", str(DEFAULT_PREFIX / "bin" / "crabd-init")))


def runc_binary() -> str:
    return os.environ.get("CRABD_RUNC", "runc")


def exec_channel() -> bool:
    """New sandboxes get the fast exec path (crabd/runtime/channel.py): on
    unless CRABD_EXEC_CHANNEL=0 (it passed the exec tests of the runtime, the
    daemon and the inspector; bench/results/latency/2026-12-02-channel-default);
    `runc exec` stays the fallback either way."""
    return os.environ.get("CRABD_EXEC_CHANNEL", "1").strip().lower() not in ("0", "false", "no", "off")
