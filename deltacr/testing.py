"""Fakes of deltacr's command seam, so unit tests drive real logic without root,
and CRIU image bytes made by hand (`pb_varint`, `pagemap_image`).

    fake = FakeCommandRunner()
    fake.on("--version", output=b"Version: 4.1.1\\n")
    fake.on("checkpoint", returncode=1, output=b"criu failed", writes={"dump.log": ERROR_LOG})
    Runc("/run/r", runner=fake).checkpoint("sb-1", img, work)   # raises CriuFailed
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

from .runc import Result

__all__ = ["FakeCommandRunner", "pb_varint", "pagemap_image"]

# CRIU's image magic of pagemap-*.img (criu/include/magic.h: PAGEMAP_MAGIC after IMG_COMMON)
PAGEMAP_HEAD = b"\x19\x43\x56\x54\x25\x40\x08\x56"


def pb_varint(n: int) -> bytes:
    """A protobuf varint."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _entry(fields: dict[int, int]) -> bytes:
    body = b"".join(pb_varint(num << 3) + pb_varint(v) for num, v in fields.items())
    return struct.pack("<I", len(body)) + body


def pagemap_image(pages_id: int, runs: list[tuple[int, int]], flags: int = 4) -> bytes:
    """A pagemap-*.img: its head (pages_id), then one entry per (vaddr, pages) run (flags 4: PE_PRESENT)."""
    data = PAGEMAP_HEAD + _entry({1: pages_id})
    for va, nr in runs:
        data += _entry({1: va, 2: nr, 4: flags})
    return data


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
