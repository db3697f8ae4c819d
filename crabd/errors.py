"""crabd's errors, drawn once.

    CrabdError                     base; .code is the API error code
    ├── NotFound                   unknown sandbox / image / checkpoint id   (404)
    ├── AlreadyExists              a name that is taken                      (409)
    ├── FailedPrecondition         valid request, wrong state: image in use,
    │   │                          sandbox not running, host not prepared   (409)
    │   ├── SandboxNotRunning      the sandbox's init is gone
    │   ├── BudgetExceeded         a lineage's budget (turns, time, cost,
    │                              retries) is used up
    │   └── JobCancelled           a queued checkpoint job was dropped (its
    │                              sandbox rolled back) before it ran
    ├── InvalidArgument            malformed input: bad name, bad path       (422)
    │   └── SettingsError          the config file or an override is invalid
    ├── IntegrityError             stored metadata does not match its digest (500)
    ├── ExecError                  a command inside a sandbox could not run
    │   ├── CommandNotFound        argv[0] does not exist in the sandbox     (422)
    │   ├── CommandNotExecutable   argv[0] exists but cannot be executed     (422)
    │   └── ExecTimeout            the command outlived its timeout          (408)
    └── CommandFailed              an external tool (runc, debootstrap, ...)
                                   failed; carries argv and its stderr       (500)
    (FailedPrecondition) └── RegistryError  an OCI registry refused or was
                                   unreachable during a push/pull           (502)

Foreign exceptions (subprocess, sqlite3, docker, OSError from the kernel) are
converted where they enter crabd, with the context of what crabd was doing.
Every class here has its own `code`; the client maps a code back to its class
(`by_code`), so a caller catches the daemon's errors by type.
deltafs, deltacr and ebpf are libraries that never import crabd and keep
their own error modules (deltacr.CommandFailed included). Their errors are
converted to these classes at one seam, `from_library`, where they reach the
API: a deltacr.CommandFailed is a CommandFailed to a client, a deltafs or
deltacr NotFound a NotFound, and so on by category.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "CrabdError",
    "NotFound",
    "AlreadyExists",
    "FailedPrecondition",
    "SandboxNotRunning",
    "BudgetExceeded",
    "JobCancelled",
    "InvalidArgument",
    "SettingsError",
    "IntegrityError",
    "ExecError",
    "CommandNotFound",
    "CommandNotExecutable",
    "ExecTimeout",
    "CommandFailed",
    "RegistryError",
    "by_code",
    "from_library",
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


class BudgetExceeded(FailedPrecondition):
    """A lineage's budget (turns, wall time, cost, retries) is used up."""

    code = "budget_exceeded"


class JobCancelled(FailedPrecondition):
    """A queued job was removed before it ran (e.g. its sandbox was rolled back)."""

    code = "job_cancelled"


class InvalidArgument(CrabdError):
    code = "invalid_argument"
    http_status = 422


class SettingsError(InvalidArgument):
    """The configuration file (or an override) is unreadable or invalid."""

    code = "invalid_config"

    def __init__(self, message: str, *, path: Path | None = None, field: str | None = None, fix: str | None = None) -> None:
        self.path = path
        self.field = field
        super().__init__(message, fix=fix)


class IntegrityError(CrabdError):
    """Stored metadata does not match its digest: it was changed behind crabd's back."""

    code = "integrity_error"
    http_status = 500


class ExecError(CrabdError):
    code = "exec_error"
    http_status = 422


class CommandNotFound(ExecError):
    code = "command_not_found"


class CommandNotExecutable(ExecError):
    code = "command_not_executable"


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


class RegistryError(FailedPrecondition):
    """An OCI registry refused, failed or could not be reached during a push
    or pull of a checkpoint (crabd.remote); nothing local was changed."""
    code = "registry_error"
    http_status = 502


def by_code() -> dict[str, type[CrabdError]]:
    """Each error class by its API `code` (the client raises the class the
    daemon raised). Derived from the classes, so a new class is mapped."""
    out: dict[str, type[CrabdError]] = {}
    todo: list[type[CrabdError]] = [CrabdError]
    while todo:
        cls = todo.pop(0)
        out.setdefault(cls.code, cls)
        todo += cls.__subclasses__()
    return out


# The libraries' categories (containerd's errdefs, in deltafs and deltacr
# alike) and crabd's class for each.
_CATEGORIES: dict[str, type[CrabdError]] = {
    "NotFound": NotFound, "AlreadyExists": AlreadyExists, "InvalidArgument": InvalidArgument,
    "FailedPrecondition": FailedPrecondition, "ImageCorrupted": IntegrityError,
}


def from_library(e: Exception) -> CrabdError | None:
    """crabd's error for an error of deltafs or deltacr (None for anything
    else): a command that failed is a CommandFailed with its argv and output;
    otherwise the class of the error's category (its nearest base named in
    `_CATEGORIES`), else a plain CrabdError (500) with the library's message."""
    if type(e).__module__.split(".")[0] not in ("deltafs", "deltacr"):
        return None
    fix = getattr(e, "fix", None)
    if type(e).__name__ == "CommandFailed":
        return CommandFailed(getattr(e, "argv", []), getattr(e, "returncode", -1), getattr(e, "output", ""),
                             context=getattr(e, "context", ""), fix=fix)
    message = getattr(e, "message", None) or str(e)
    for cls in type(e).__mro__:
        if cls.__name__ in _CATEGORIES:
            return _CATEGORIES[cls.__name__](message, fix=fix)
    return CrabdError(str(e), fix=fix or "see crabd's log")
