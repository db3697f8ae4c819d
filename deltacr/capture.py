"""File system and processes captured at one instant.

The sandbox is frozen (cgroup freezer) from the moment the file-system
commit starts until CRIU's dump is done, then thawed: nothing can write a
file after the commit and before the dump, so a restore never pairs
processes with a file system from another moment.

`runc checkpoint` works on a container whose freezer cgroup is already
FROZEN on these hosts: runc hands CRIU the freezer cgroup, CRIU seizes the
frozen tasks, dumps them and puts the cgroup back in the state it found it
(FROZEN), so our thaw is the only one. Checked with runc 1.1.5 + CRIU 4.1.1
(tests/integration/deltacr/test_deltacr_cr.py::test_consistent_capture_keeps_frozen).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

__all__ = ["Capture", "capture_consistent"]

T = TypeVar("T")


@dataclass(frozen=True)
class Capture(Generic[T]):
    fs_result: Any        # what the file-system commit returned (None without one)
    dump_result: T        # what the dump returned
    pause_seconds: float  # frozen: from the start of the freeze to the end of the thaw
    freeze_seconds: float
    fs_seconds: float
    dump_seconds: float


def capture_consistent(freeze: Callable[[], None], thaw: Callable[[], None], dump: Callable[[], T],
                       fs_commit: Callable[[], Any] | None = None,
                       clock: Callable[[], float] = time.monotonic) -> Capture[T]:
    """freeze -> fs_commit() -> dump() -> thaw, thawing whatever fails.

    A failure of `dump` after a successful `fs_commit` re-raises the dump's
    error with `.fs_result` set, so the caller can keep or drop that commit."""
    t0 = clock()
    freeze()
    t1 = clock()
    fs_result = None
    try:
        if fs_commit is not None:
            fs_result = fs_commit()
        t2 = clock()
        try:
            res = dump()
        except BaseException as e:
            e.fs_result = fs_result  # type: ignore[attr-defined]
            raise
        t3 = clock()
    finally:
        thaw()
    t4 = clock()
    return Capture(fs_result, res, t4 - t0, t1 - t0, t2 - t1, t3 - t2)
