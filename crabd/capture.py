"""Capture modes: what a turn-end checkpoint saves, whatever the classifier planned.

* ``auto`` (default): the classifier's plan (SKIP / FS / FS_PROC).
* ``fs-only``: never dump processes: FS_PROC becomes FS (SKIP stays SKIP).
  Such a checkpoint holds no process image and does not inherit its
  parent's, since the turn ran the sandbox's processes.
* ``full``: every turn is FS_PROC: a snapshot of the files and a CRIU dump of
  the processes, whatever the turn did. It is captured, stored and counted
  exactly as crabd's own FS_PROC turns are (the copy-on-write snapshot; the
  dump into the chunked, zstd-compressed, de-duplicated image store; `bytes`
  = the snapshot's bytes over its parent + the store's new bytes), so it is
  the fair "checkpoint everything every turn" baseline of the recovery
  benchmark: what an engineer with these parts would ship without a
  classifier, and against which crabd's plans are measured, nothing else.
  (Until issue 14 it also wrote a tar of every file changed since the image
  and counted the raw CRIU image: a copy nobody restored from, and bytes no
  store here writes. The benchmark still reports that naive figure, computed
  after the run: bench/recovery.py, "Bytes".)

The mode is daemon-wide (`crabd serve --capture`, config key `capture`); the
mode a checkpoint was opened under is written into its reasons, so a capture
that runs after a restart in another mode still does what was planned.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

__all__ = ["CaptureMode", "MODES", "FS_ONLY_REASON", "FULL_REASON", "apply_mode", "processes_skipped"]


class CaptureMode(str, Enum):
    AUTO = "auto"
    FS_ONLY = "fs-only"
    FULL = "full"


MODES = tuple(m.value for m in CaptureMode)
FS_ONLY_REASON = "capture mode fs-only: processes not dumped"
FULL_REASON = "capture mode full: files and processes checkpointed every turn"


def apply_mode(kind: str, reasons: Iterable[str], mode: str | CaptureMode) -> tuple[str, list[str]]:
    """The plan a checkpoint gets under capture `mode`, from the classifier's `kind`. Pure."""
    reasons = list(reasons)
    try:
        m = CaptureMode(mode)
    except ValueError:
        raise ValueError(f"unknown capture mode {mode!r}: one of {', '.join(MODES)}") from None
    if m is CaptureMode.FS_ONLY and kind == "FS_PROC":
        return "FS", reasons + [FS_ONLY_REASON]
    if m is CaptureMode.FULL:
        return "FS_PROC", reasons + [FULL_REASON]
    return kind, reasons


def processes_skipped(reasons: Iterable[str] | None) -> bool:
    """Did capture mode fs-only turn this checkpoint's FS_PROC plan into FS?
    Then the turn ran the sandbox's processes and the checkpoint must not
    inherit its parent's process image. (Read from the reasons, where
    `apply_mode` wrote it: the mode the checkpoint was opened under.)"""
    return FS_ONLY_REASON in (reasons or ())

