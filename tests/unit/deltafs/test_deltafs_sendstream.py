"""The btrfs send stream reader: which paths a stream's commands name."""

from __future__ import annotations

import struct

import pytest

from deltafs.sendstream import MAGIC, touched_paths


def _cmd(cmd: int, *attrs: tuple[int, bytes]) -> bytes:
    body = b"".join(struct.pack("<HH", t, len(v)) + v for t, v in attrs)
    return struct.pack("<IHI", len(body), cmd, 0) + body


def _stream(*cmds: bytes, version: int = 1) -> bytes:
    return MAGIC + struct.pack("<I", version) + b"".join(cmds)


def test_paths_of_every_command_rename_targets_and_link_sources():
    s = _stream(
        _cmd(2, (15, b"3"), (1, b"u" * 16)),          # snapshot: the subvolume's name, not a path
        _cmd(10, (15, b"lnk"), (17, b"x/y/f")),       # link lnk -> existing x/y/f
        _cmd(9, (15, b"dd"), (16, b"zz")),            # rename
        _cmd(8, (15, b"o264-8-0"), (17, b"/etc/passwd"), (3, b"\0" * 8)),  # symlink: PATH_LINK is its text
        _cmd(11, (15, b"g")),                         # unlink
        _cmd(20, (15, b""), (10, b"\0" * 12)),        # utimes of the root
        _cmd(21))
    assert touched_paths(s) == {b"lnk", b"x/y/f", b"dd", b"zz", b"o264-8-0", b"g", b""}


@pytest.mark.parametrize("bad", [
    b"not a stream",
    _stream(_cmd(11, (15, b"g"))),                    # no end command
    _stream(_cmd(21), version=2),                     # a protocol this reader does not know
    _stream(_cmd(11, (15, b"g")))[:-1] + _cmd(21),    # an attribute crossing its command's end
    _stream(_cmd(11, (15, b"g")))[:-3],               # cut short
])
def test_a_malformed_stream_is_refused(bad):
    with pytest.raises(ValueError):
        touched_paths(bad)
