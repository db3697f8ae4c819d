"""deltacr's errors, drawn once.

    DeltacrError                 base
    ├── NotFound                 unknown checkpoint / standby
    ├── AlreadyExists            a checkpoint id that is taken
    ├── InvalidArgument          malformed options or ids
    ├── FailedPrecondition       the host or the sandbox is in the wrong state
    │   └── CriuUnavailable      CRIU missing, too old, or lacking a feature;
    │                            .missing lists what
    ├── CriuFailed               a dump or restore failed; .errors holds the
    │                            `Error` lines of CRIU's own log, .log_path
    │                            where that log was kept
    ├── ImageCorrupted           a stored image failed its integrity check;
    │                            never restored
    └── CommandFailed            runc (or criu) failed before CRIU logged
                                 anything; .argv, .output

Foreign exceptions (subprocess, OSError, json) are converted where they
enter deltacr, with the context of what deltacr was doing.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["DeltacrError", "NotFound", "AlreadyExists", "InvalidArgument", "FailedPrecondition",
           "CriuUnavailable", "CriuFailed", "ImageCorrupted", "CommandFailed"]


class DeltacrError(Exception):
    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if not fix else f"{message} (fix: {fix})")


class NotFound(DeltacrError):
    pass


class AlreadyExists(DeltacrError):
    pass


class InvalidArgument(DeltacrError):
    pass


class FailedPrecondition(DeltacrError):
    pass


class CriuUnavailable(FailedPrecondition):
    def __init__(self, message: str, *, missing: Sequence[str] = (), fix: str | None = None) -> None:
        self.missing = list(missing)
        super().__init__(message, fix=fix)


class CriuFailed(DeltacrError):
    """A dump or restore failed. `errors` are CRIU's own `Error` lines (the
    rlimit noise of these hosts filtered out), `context` the lines just
    before the first of them, `log_path` where the full log was kept."""

    def __init__(self, what: str, *, errors: Sequence[str], context: Sequence[str] = (),
                 log_path: str | None = None, output: str = "") -> None:
        self.what = what
        self.errors = list(errors)
        self.context = list(context)
        self.log_path = log_path
        self.output = output
        super().__init__(what)

    def __str__(self) -> str:  # log_path may be updated once the log is kept
        if self.errors:
            detail = "; ".join(self.errors[:6])
        else:
            tail = [ln for ln in self.output.strip().splitlines() if ln.strip()][-3:]
            detail = " | ".join(tail) or "no error lines in CRIU's log"
        where = f" (CRIU log: {self.log_path})" if self.log_path else ""
        return f"{self.what} failed: {detail}{where}"


class ImageCorrupted(DeltacrError):
    def __init__(self, checkpoint_id: str, detail: str) -> None:
        self.checkpoint_id = checkpoint_id
        super().__init__(f"process image of checkpoint {checkpoint_id!r} is corrupted and will not be restored: {detail}",
                         fix="roll back to another checkpoint; this one's process image cannot be trusted")


class CommandFailed(DeltacrError):
    def __init__(self, argv: Sequence[str], returncode: int, output: str, *, context: str = "") -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.output = output
        self.context = context
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-4:]
        super().__init__(f"{context or ' '.join(argv[:3])} failed (exit {returncode}): {' | '.join(tail) or 'no output'}")
