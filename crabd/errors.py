"""crabd's errors, drawn once.

    CrabdError                     base; .code is the API error code
    ├── NotFound                   unknown sandbox / image / checkpoint id   (404)
    ├── AlreadyExists              a name that is taken                      (409)
    ├── FailedPrecondition         valid request, wrong state: image in use,
    │   │                          sandbox not running, host not prepared   (409)
    │   └── SandboxNotRunning      the sandbox's init is gone
    ├── InvalidArgument            malformed input: bad name, bad path       (422)
    ├── ExecError                  a command inside a sandbox could not run
    │   ├── CommandNotFound        argv[0] does not exist in the sandbox     (422)
    │   └── ExecTimeout            the command outlived its timeout          (408)
    └── CommandFailed              an external tool (runc, debootstrap, ...)
                                   failed; carries argv and its stderr       (500)

Foreign exceptions (subprocess, sqlite3, docker, OSError from the kernel) are
converted where they enter crabd, with the context of what crabd was doing.
"""

from __future__ import annotations

__all__ = [
    "CrabdError",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "SandboxNotRunning",
    "InvalidArgument",
    "ExecError",
    "CommandNotFound",
    "ExecTimeout",
    "CommandFailed",
]


class CrabdError(Exception):
    """Base of every error crabd raises on purpose."""

    code = "internal"
    http_status = 500

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if not fix else f"{message} (fix: {fix})")


class NotFound(CrabdError):
    code = "not_found"
    http_status = 404


class AlreadyExists(CrabdError):
    code = "already_exists"
    http_status = 409


class FailedPrecondition(CrabdError):
    code = "failed_precondition"
    http_status = 409


class SandboxNotRunning(FailedPrecondition):
    code = "sandbox_not_running"


class InvalidArgument(CrabdError):
    code = "invalid_argument"
    http_status = 422


class ExecError(CrabdError):
    code = "exec_error"
    http_status = 422


class CommandNotFound(ExecError):
    code = "command_not_found"


class ExecTimeout(ExecError):
    code = "exec_timeout"
    http_status = 408

    def __init__(self, message: str, *, stdout: str = "", stderr: str = "", timeout: float = 0.0) -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr
        self.timeout = timeout


class CommandFailed(CrabdError):
    code = "command_failed"
    http_status = 500

    def __init__(self, argv: list[str], returncode: int, stderr: str, *, context: str = "", fix: str | None = None) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        tail = stderr.strip().splitlines()[-5:]
        what = context or " ".join(argv[:3])
        super().__init__(f"{what} failed (exit {returncode}): {' | '.join(tail) or 'no stderr'}", fix=fix)
