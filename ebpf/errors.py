"""Errors raised by the ebpf library.

    InspectorError                 base of everything raised here
    ├── BPFUnavailable             BPF cannot be used on this host (the message says why
    │                              and how to fix it); callers fall back to ProcInspector
    ├── NotWatched                 unknown sandbox id
    ├── AlreadyWatched             sandbox id or cgroup already watched
    └── InvalidArgument            e.g. a cgroup path that is not a cgroup v2 directory

bcc's own exceptions are converted to BPFUnavailable where they enter (ebpf._bcc).
"""

from __future__ import annotations


class InspectorError(Exception):
    """Base class of the ebpf library's errors."""


class BPFUnavailable(InspectorError):
    """BPF programs cannot be loaded here; the message carries the fix."""


class NotWatched(InspectorError, KeyError):
    """The sandbox is not watched by this inspector."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not watched"


class AlreadyWatched(InspectorError):
    """The sandbox (or its cgroup) is already watched."""


class InvalidArgument(InspectorError, ValueError):
    """An argument the inspector cannot use (the message says which and why)."""
