"""bench/torn.py's page checks (pure): every instant of the worker's write
sequence passes; a copy racing the writes (the oracle's s5 turn 9 page:
the step from before, the rest from after) fails; the page at the state
address is found in a CRIU image directory."""

from __future__ import annotations

import struct
from pathlib import Path

import bench.torn as T
from crabd.oracle import parse_state_page
from deltacr.testing import pagemap_image


def _writes(n0: int, n1: int) -> list[tuple[int, int]]:
    """(word index, value) stores of iterations n0+1..n1, in the worker's order."""
    out = []
    for n in range(n0 + 1, n1 + 1):
        out += [(1, n), (2, n), (3, n), (4, n), (5, n), (8, n)]
        i = n % T.RING
        out += [(10 + 3 * i, n), (11 + 3 * i, n), (12 + 3 * i, n), ((80 + 24 * T.RING) // 8 + i, n)]
    return out


def _page(stores: list[tuple[int, int]]) -> bytearray:
    w = [0] * 512
    for i, v in stores:
        w[i] = v
    b = bytearray(struct.pack("<512Q", *w))
    b[:8] = T.MAGIC
    b[48:53] = b"tight"
    return b


def test_every_instant_of_the_worker_passes() -> None:
    seq = _writes(0, 40)
    for k in range(len(seq) + 1):
        b = _page(seq[:k])
        assert T.check_page(bytes(b)) is None, k
        assert parse_state_page(bytes(b)) is not None  # the oracle's truth reads it too


def test_a_copy_racing_the_writes_fails() -> None:
    seq = _writes(0, 40)
    before, after = _page(seq[:6 * 10]), _page(seq)
    torn = bytes(before[:16] + after[16:])  # step copied before the writes, the rest after
    assert T.check_page(torn) is not None
    ring_ahead = bytes(before[:80] + after[80:])
    assert "ring" in (T.check_page(ring_ahead) or "")
    # the oracle's s5 turn 9 shape: step 0, hash and ring of step 1
    s5 = bytes(_page([])[:16] + _page(_writes(0, 1))[16:])
    assert T.check_page(s5) is not None


def test_image_pages_finds_the_state_page(tmp_path: Path) -> None:
    runs = [(0x400000, 2), (T.ADDR - 4096, 3)]
    (tmp_path / "pagemap-33.img").write_bytes(pagemap_image(7, runs))
    state = bytes(_page(_writes(0, 3)))
    pages = [b"a" * 4096, b"b" * 4096, b"c" * 4096, state, b"d" * 4096]
    (tmp_path / "pages-7.img").write_bytes(b"".join(pages))
    assert T.image_pages(tmp_path) == {"33": state}
