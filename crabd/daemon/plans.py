"""What a checkpoint's reasons record, and the decisions taken from them.

Part of `crabd.daemon`. A checkpoint row's `reasons` are text for people
(stored, shown by the API and the CLI). Code never searches them itself: it
asks the helpers here (and `crabd.capture.processes_skipped`), so each
reason string is written in one place and read in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from ..store import CheckpointRow

__all__ = ["DIED_REASON", "BLIND_RESTART", "BLIND_RESTORED", "blind_reason", "save_everything", "died_during_turn",
           "is_complete"]

# In the reasons of a checkpoint of a turn during which the sandbox died: its
# files are the command's half-done work, so it is no recovery target (the
# agent retries the turn from the checkpoint before).
DIED_REASON = "the sandbox died during this turn: not a recovery target"

# Why a checkpoint saves everything (FS_PROC) whatever the inspector saw: a
# plan that saves less claims that nothing else changed since the checkpoint
# it shares state with, and that claim needs an unbroken record back to a
# durable checkpoint. Three things break the record: a restart of crabd (what
# the sandbox did while no inspector watched is unknown), a capture that did
# not commit (its turn's changes were never saved: the next plan must cover
# them too), and processes restored by a rollback or fork that ran before the
# inspector watched them again.
BLIND_RESTART = "crabd restarted: what the sandbox did while crabd was down was not seen"
BLIND_RESTORED = "processes were restored and ran before the inspector watched them"


def blind_reason(why: str) -> str:
    return f"saving everything: {why}"


def save_everything(why: str, reasons: Sequence[str]) -> tuple[str, list[str]]:
    """The plan and reasons of a checkpoint that saves everything because the
    record is broken (`why`), whatever its plan was: the reason is said even
    when the plan was FS_PROC already, as it is why the next ones may save
    less. The capture mode (crabd.capture.apply_mode) still applies after."""
    return "FS_PROC", [blind_reason(why)] + list(reasons)


def died_during_turn(reasons: Sequence[str] | None) -> bool:
    """Was the checkpoint taken of a turn the sandbox died in?"""
    return DIED_REASON in (reasons or [])


def is_complete(ck: CheckpointRow) -> bool:
    """Does a committed checkpoint hold everything its plan asked for, and is
    it a recovery target? Not an FS_PROC checkpoint whose CRIU dump failed
    (files but no processes), nor one of a turn the sandbox died in."""
    return not (ck.plan == "FS_PROC" and not ck.proc_image) and not died_during_turn(ck.reasons)
