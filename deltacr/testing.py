"""Fakes of deltacr's command seam, so unit tests drive real logic without root.

    fake = FakeCommandRunner()
    fake.on("--version", output=b"Version: 4.1.1\\n")
    fake.on("checkpoint", returncode=1, output=b"criu failed", writes={"dump.log": ERROR_LOG})
    Runc("/run/r", runner=fake).checkpoint("sb-1", img, work)   # raises CriuFailed
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .runc import Result

__all__ = ["FakeCommandRunner"]


@dataclass
class _Rule:
    words: tuple[str, ...]
    returncode: int | None
    output: bytes
    writes: dict[str, bytes]


@dataclass
class FakeCommandRunner:
    calls: list[list[str]] = field(default_factory=list)
    rules: list[_Rule] = field(default_factory=list)

    def on(self, *words: str, returncode: int | None = 0, output: bytes = b"",
           writes: dict[str, bytes] | None = None) -> None:
        """Answer commands containing all `words` (latest rule wins). `writes`
        puts files into the command's --work-path (CRIU's logs) or, for
        `restore.pid`, next to it."""
        self.rules.insert(0, _Rule(words, returncode, output, dict(writes or {})))

    envs: list[dict[str, str] | None] = field(default_factory=list)

    def run(self, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
            progress=None, stall: float | None = None) -> Result:  # type: ignore[no-untyped-def]
        self.calls.append(list(argv))
        self.envs.append(dict(env) if env else None)
        for r in self.rules:
            if all(w in argv for w in r.words):
                if r.writes and "--work-path" in argv:
                    wd = argv[argv.index("--work-path") + 1]
                    os.makedirs(wd, exist_ok=True)
                    for name, data in r.writes.items():
                        with open(os.path.join(wd, name), "wb") as f:
                            f.write(data)
                return Result(list(argv), r.returncode, r.output, 0.001)
        if "--version" in argv:
            return Result(list(argv), 0, b"Version: 4.1.1\n", 0.001)
        if "--feature" in argv:
            return Result(list(argv), 0, f"{argv[-1]} is supported\n".encode(), 0.001)
        return Result(list(argv), 0, b"", 0.001)
