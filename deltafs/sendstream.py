"""The paths a btrfs send stream touches: what changed between two read-only
subvolumes, found by the kernel from their shared trees (O(changes), not
O(tree)).

`btrfs send --no-data -p OLD NEW` writes a stream of commands (mkfile,
rename, unlink, utimes, set_xattr, update_extent, ...) that turn OLD into
NEW; every command names the path it acts on. `touched_paths` parses a
version-1 stream (btrfs-progs' send-stream.c: a 17-byte header, then
commands of `le32 len, le16 cmd, le32 crc` and TLV attributes `le16 type,
le16 len`) and returns every path a command names: the path it acts on,
the destination of a rename and the existing name a hard link is made to.
Some are intermediate names (an inode moved out of the way as
`o<ino>-<gen>-<n>` before its final rename); the caller compares each
candidate in both trees, so a name that exists in neither changes nothing.
Pure: bytes in, paths out; a malformed stream raises ValueError.
"""

from __future__ import annotations

import struct

__all__ = ["touched_paths", "MAGIC"]

MAGIC = b"btrfs-stream\0"

# Commands (send.h, protocol version 1).
CMD_SUBVOL, CMD_SNAPSHOT, CMD_SYMLINK, CMD_LINK, CMD_END = 1, 2, 8, 10, 21
# Attributes.
A_PATH, A_PATH_TO, A_PATH_LINK = 15, 16, 17

_CMD = struct.Struct("<IHI")
_TLV = struct.Struct("<HH")


def touched_paths(stream: bytes) -> set[bytes]:
    """Every path the commands of a version-1 send stream name (b"" for the root)."""
    if not stream.startswith(MAGIC) or len(stream) < len(MAGIC) + 4:
        raise ValueError("not a btrfs send stream (no header)")
    (version,) = struct.unpack_from("<I", stream, len(MAGIC))
    if version != 1:
        raise ValueError(f"btrfs send stream version {version}: only version 1 is read")
    pos = len(MAGIC) + 4
    out: set[bytes] = set()
    end = False
    while pos < len(stream):
        if pos + _CMD.size > len(stream):
            raise ValueError("btrfs send stream cut inside a command header")
        length, cmd, _crc = _CMD.unpack_from(stream, pos)
        pos += _CMD.size
        stop = pos + length
        if stop > len(stream):
            raise ValueError("btrfs send stream cut inside a command")
        attrs: dict[int, bytes] = {}
        while pos < stop:
            if pos + _TLV.size > stop:
                raise ValueError("btrfs send stream: an attribute crosses its command's end")
            typ, n = _TLV.unpack_from(stream, pos)
            pos += _TLV.size
            if pos + n > stop:
                raise ValueError("btrfs send stream: an attribute crosses its command's end")
            attrs[typ] = stream[pos:pos + n]
            pos += n
        if cmd == CMD_END:
            end = True
            break
        if cmd in (CMD_SUBVOL, CMD_SNAPSHOT):
            continue  # names the subvolume, not a path in it
        for typ in (A_PATH, A_PATH_TO):
            if typ in attrs:
                out.add(attrs[typ].rstrip(b"\0"))
        if cmd == CMD_LINK and A_PATH_LINK in attrs:  # (a symlink's PATH_LINK is its target text)
            out.add(attrs[A_PATH_LINK].rstrip(b"\0"))
    if not end:
        raise ValueError("btrfs send stream without its end command")
    return out
