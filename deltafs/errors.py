"""The errors deltafs raises, drawn once.

Every error a caller can act on is one of four categories, modelled on
containerd's errdefs; an error adds context (which snapshot, what to do) and
keeps the category so callers (crabd's API maps them to HTTP statuses) can
branch on the class alone::

    DeltafsError                 base; never raised itself
    ├── NotFound                 no snapshot with that key/name
    ├── AlreadyExists            the key/name is taken
    ├── FailedPrecondition       the operation is valid but the state forbids it
    │                            (remove with children, commit of a committed
    │                            snapshot, pool not mountable, host lacks a
    │                            kernel feature, state dir locked by another process)
    └── InvalidArgument          the request itself is wrong (bad name, a parent
                                 that is not committed, mount options too long)

Foreign exceptions (sqlite3.Error, OSError from ioctl/mount) are converted
where they enter deltafs when their meaning is one of the above; other
OSErrors propagate unchanged because they mean the host failed (EIO, ENOSPC).
`deltafs.mount.MountError` is an OSError on purpose: mount(2) failing is the
host failing, not a misuse of the snapshot model.
"""

from __future__ import annotations

__all__ = ["DeltafsError", "NotFound", "AlreadyExists", "FailedPrecondition", "InvalidArgument"]


class DeltafsError(Exception):
    """Base of every deltafs error; carries a message meant for a human."""


class NotFound(DeltafsError):
    """No snapshot with the given key or name."""


class AlreadyExists(DeltafsError):
    """A snapshot with the given key or name already exists."""


class FailedPrecondition(DeltafsError):
    """The system is not in a state where the operation can run (the message says how to fix it)."""


class InvalidArgument(DeltafsError):
    """The arguments are invalid whatever the state (bad name, wrong kind of parent)."""
