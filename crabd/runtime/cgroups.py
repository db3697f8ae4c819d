"""Where runc puts a sandbox's cgroups, and the freezer.

runc (cgroupfs driver) places a container with cgroupsPath `/crabd/<id>` at
`<hierarchy>/crabd/<id>` in every v1 controller and, on hybrid hosts, in the
unified (v2) hierarchy too -- which is what BPF attribution keys on.

Freezing writes the cgroup's freezer file directly instead of running
`runc pause` (a process spawn, ~10 ms): a freeze+thaw of a small sandbox
costs ~0.3 ms this way, and it is on the checkpoint's critical path.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import FailedPrecondition

__all__ = ["CgroupLayout", "detect_layout", "Freezer"]

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupLayout:
    """Which cgroup hierarchies this host has. Pure data, detected once."""

    v2_only: bool            # pure cgroup v2 (unified at /sys/fs/cgroup)
    unified: Path | None     # the v2 hierarchy (hybrid: /sys/fs/cgroup/unified)
    v1_freezer: Path | None  # /sys/fs/cgroup/freezer on v1/hybrid hosts

    def freezer_dir(self, rel: str) -> Path:
        rel = rel.lstrip("/")
        if self.v1_freezer is not None:
            return self.v1_freezer / rel
        if self.unified is not None:
            return self.unified / rel
        raise FailedPrecondition("no cgroup freezer on this host", fix="mount the v1 freezer or use cgroup v2")

    def v2_dir(self, rel: str) -> Path | None:
        return self.unified / rel.lstrip("/") if self.unified is not None else None


def detect_layout(root: Path = CGROUP_ROOT) -> CgroupLayout:
    if (root / "cgroup.controllers").exists():
        return CgroupLayout(v2_only=True, unified=root, v1_freezer=None)
    unified = root / "unified"
    freezer = root / "freezer"
    return CgroupLayout(
        v2_only=False,
        unified=unified if (unified / "cgroup.procs").exists() else None,
        v1_freezer=freezer if (freezer / "freezer.state").exists() or (freezer / "tasks").exists() else None,
    )


class Freezer:
    """Freeze and thaw one cgroup (v1 freezer.state or v2 cgroup.freeze)."""

    def __init__(self, layout: CgroupLayout, rel: str) -> None:
        self.layout = layout
        self.dir = layout.freezer_dir(rel)
        self.v1 = layout.v1_freezer is not None

    def freeze(self, timeout: float = 10.0) -> None:
        if self.v1:
            self._write("freezer.state", "FROZEN")
            self._wait(lambda: self._read("freezer.state") == "FROZEN", timeout, "freeze")
        else:
            self._write("cgroup.freeze", "1")
            self._wait(lambda: "frozen 1" in self._read("cgroup.events"), timeout, "freeze")

    def thaw(self, timeout: float = 10.0) -> None:
        if self.v1:
            self._write("freezer.state", "THAWED")
            self._wait(lambda: self._read("freezer.state") == "THAWED", timeout, "thaw")
        else:
            self._write("cgroup.freeze", "0")
            self._wait(lambda: "frozen 0" in self._read("cgroup.events"), timeout, "thaw")

    def state(self) -> str:
        if self.v1:
            return self._read("freezer.state")
        return "FROZEN" if "frozen 1" in self._read("cgroup.events") else "THAWED"

    def _read(self, name: str) -> str:
        with open(self.dir / name) as f:
            return f.read().strip()

    def _write(self, name: str, value: str) -> None:
        try:
            fd = os.open(self.dir / name, os.O_WRONLY)
        except FileNotFoundError as e:
            raise FailedPrecondition(f"cgroup {self.dir} does not exist (sandbox not running?)") from e
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    @staticmethod
    def _wait(done, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        delay = 0.0001
        while not done():
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"cgroup {what} did not complete within {timeout}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
