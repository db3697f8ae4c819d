"""What an exec returns: the agent's `ExecResult`, made from the report of the
command's wrapper (runc exec) or of the sandbox's init (the exec channel).

Part of the sandbox runtime (crabd/runtime/sandbox.py runs the command; this
module says what its report means): pure, tested without root. A report is
one status line: `X code` (exited), `S signal` (killed by a signal: 128 + n,
as shells and Docker say), `E errno` (could not execute), `C errno` (could
not enter the working directory); none means the wrapper itself was killed.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CommandNotExecutable, CommandNotFound, ExecError, ExecTimeout, SandboxNotRunning

__all__ = ["ExecResult", "exec_result", "merge_env"]


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str
    duration: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "duration": self.duration, "stdout_truncated": self.stdout_truncated,
                "stderr_truncated": self.stderr_truncated}


def _marker(dropped: int) -> str:
    return f"\n[crabd: output truncated: {dropped} more bytes not shown]\n"


def merge_env(base: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    """Later entries override earlier ones by variable name. Pure."""
    merged: dict[str, str] = {}
    for e in (*base, *extra):
        k, _, v = e.partition("=")
        if not k:
            continue
        merged[k] = v
    return tuple(f"{k}={v}" for k, v in merged.items())


def exec_result(sandbox_id: str, argv: list[str], cap: Any, timeout: float | None,
                running: Callable[[], bool]) -> ExecResult:
    """The agent's result of an exec from the wrapper's (or init's) report
    (`cap`: a runner.Captured or channel's equivalent). `running`: is the
    sandbox still running, asked only when the report is missing."""
    out = cap.stdout.decode(errors="replace")
    err = cap.stderr.decode(errors="replace")
    if cap.stdout_dropped:
        out += _marker(cap.stdout_dropped)
    if cap.stderr_dropped:
        err += _marker(cap.stderr_dropped)
    if cap.timed_out:
        raise ExecTimeout(f"command {argv[0]!r} in sandbox {sandbox_id} did not finish within {timeout}s; it was killed",
                          stdout=out, stderr=err, timeout=timeout or 0.0)
    kind, _, value = (cap.status or "").partition(" ")
    if kind == "X":
        code = int(value)
    elif kind == "S":
        code = 128 + int(value)
    elif kind == "E":
        eno = int(value)
        if eno == errno.ENOENT:
            raise CommandNotFound(f"command {argv[0]!r} not found in sandbox {sandbox_id}",
                                  fix="check the program exists in the image and is on PATH, or pass a shell string")
        if eno in (errno.EACCES, errno.ENOEXEC, errno.EPERM, errno.EISDIR):
            raise CommandNotExecutable(f"{argv[0]!r} in sandbox {sandbox_id} is not executable: {os.strerror(eno)}",
                                       fix="check its mode (chmod +x) and format, or run it through a shell")
        raise ExecError(f"could not execute {argv[0]!r} in sandbox {sandbox_id}: {os.strerror(eno)}")
    elif kind == "C":
        raise ExecError(f"cannot enter the working directory in sandbox {sandbox_id}: {os.strerror(int(value))}")
    else:
        if cap.returncode != 0:
            if not running():
                raise SandboxNotRunning(f"sandbox {sandbox_id} is not running", fix="roll it back or recreate it")
            raise ExecError(f"runc exec failed in sandbox {sandbox_id}: {(err.strip().splitlines() or ['?'])[-1]}")
        # The wrapper vanished without a report: killed from outside
        # (OOM killer, the sandbox stopping).
        if not running():
            raise SandboxNotRunning(f"sandbox {sandbox_id} stopped while running {argv[0]!r}",
                                    fix="roll it back or recreate it")
        code = 137
        err += f"\n[crabd: {argv[0]!r} was killed before it could report its exit status]\n"
    return ExecResult(exit_code=code, stdout=out, stderr=err, duration=cap.duration,
                      stdout_truncated=bool(cap.stdout_dropped), stderr_truncated=bool(cap.stderr_dropped))

