"""Fakes of crabd's I/O seams, so unit tests drive real logic without root.

`FakeRunner` stands in for `crabd.runner.SubprocessRunner`: it records every
command and answers from rules keyed on argument words, e.g.

    fake = FakeRunner()
    fake.on("state", stdout=b'{"status": "running", "pid": 42}')
    fake.on_capture(status="E 2")      # the next exec: "command not found"
    rt = Runtime(tmp, runner=fake, layout=CgroupLayout(False, None, None))
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import CommandFailed
from .runner import Captured, Completed

__all__ = ["FakeRunner", "cleanup_state_dir"]


@dataclass
class _Rule:
    words: tuple[str, ...]
    returncode: int
    stdout: bytes
    stderr: bytes


@dataclass
class FakeRunner:
    calls: list[list[str]] = field(default_factory=list)
    rules: list[_Rule] = field(default_factory=list)
    captures: list[Captured] = field(default_factory=list)

    def on(self, *words: str, returncode: int = 0, stdout: bytes = b"", stderr: bytes = b"") -> None:
        """Answer commands containing all `words` (the latest rule wins)."""
        self.rules.insert(0, _Rule(words, returncode, stdout, stderr))

    def on_capture(self, *, status: str | None = "X 0", stdout: bytes = b"", stderr: bytes = b"",
                   returncode: int | None = 0, timed_out: bool = False, dropped: int = 0) -> None:
        """Queue the result of the next `capture` (an exec)."""
        self.captures.append(Captured(returncode, stdout, stderr, dropped, 0, 0.001, timed_out, status))

    def run(self, argv: list[str], *, timeout: float, input: bytes | None = None,
            check: bool = True, context: str = "", log: str | None = None) -> Completed:
        self.calls.append(list(argv))
        for r in self.rules:
            if all(w in argv for w in r.words):
                if check and r.returncode != 0:
                    raise CommandFailed(argv, r.returncode, r.stderr.decode(), context=context)
                return Completed(list(argv), r.returncode, r.stdout, r.stderr)
        return Completed(list(argv), 0, b"", b"")

    def capture(self, argv: list[str], *, timeout: float | None, input: bytes | None, cap: int,
                on_timeout: Callable[[], None] | None = None, status_fd: int | None = None,
                still_running: Callable[[], bool] | None = None) -> Captured:
        self.calls.append(list(argv))
        if not self.captures:
            raise AssertionError(f"FakeRunner: unexpected capture of {argv}")
        c = self.captures.pop(0)
        if c.timed_out and on_timeout:
            on_timeout()
        return c


def cleanup_state_dir(path: Path) -> None:
    """Unmount everything under a (test) state dir, deepest first, then delete it."""
    real = str(Path(path).resolve())
    mps = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == real or mp.startswith(real + "/"):
                mps.append(mp)
    for mp in sorted(mps, key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
