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

from typing import Iterable

__all__ = ["MODES", "FS_ONLY_REASON", "FULL_REASON", "apply_mode"]

MODES = ("auto", "fs-only", "full")
FS_ONLY_REASON = "capture mode fs-only: processes not dumped"
FULL_REASON = "capture mode full: files and processes checkpointed every turn"


def apply_mode(kind: str, reasons: Iterable[str], mode: str) -> tuple[str, list[str]]:
    """The plan a checkpoint gets under capture `mode`, from the classifier's `kind`. Pure."""
    reasons = list(reasons)
    if mode == "auto":
        return kind, reasons
    if mode == "fs-only":
        if kind == "FS_PROC":
            return "FS", reasons + [FS_ONLY_REASON]
        return kind, reasons
    if mode == "full":
        return "FS_PROC", reasons + [FULL_REASON]
    raise ValueError(f"unknown capture mode {mode!r}: one of {', '.join(MODES)}")

