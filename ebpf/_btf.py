"""Struct member offsets of the running kernel, read from its BTF.

The BPF program follows a few kernel pointers to learn which file system an
opened file landed on (ebpf/inspector.c, `fd_fs`): task_struct -> files ->
fdt -> fd[n] -> f_inode -> i_sb -> s_magic, and the inode's mode. bcc
compiles against the kernel headers Debian ships (6.12 here), which do not
match the running kernel (6.18 here: `task_struct.fs` is at byte 3040 in the
headers, 1816 in the kernel). So the offsets come from the running kernel's
own type information, /sys/kernel/btf/vmlinux, and are compiled in as
constants; a kernel without BTF, or a member not found, leaves the check
off (the path rules and the tmpfs manifest still apply) and says so.

Only what is needed to find members is parsed (see the kernel's
Documentation/bpf/btf.rst for the format): the type section, the string
section, and struct/union members, descending into anonymous members.
Pure apart from reading the file; tested on the host's BTF and on
hand-built blobs.

Parsing the kernel's BTF takes seconds (some 5 MB of types, in Python), and
the running kernel's types cannot change before the next boot: the offsets
are kept per boot (the boot id and the kernel release are their key), in
this process and in a small file under /run (a tmpfs, emptied at boot), so
only the first inspector load of a boot parses.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["VMLINUX", "BtfError", "Btf", "load", "member_offset", "fd_fs_offsets"]

VMLINUX = Path("/sys/kernel/btf/vmlinux")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
CACHE = Path("/run/ebpf-fd-fs-offsets.json")
MAGIC = 0xEB9F

# kinds (BTF_KIND_*)
INT, PTR, ARRAY, STRUCT, UNION, ENUM, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT = range(1, 12)
FUNC, FUNC_PROTO, VAR, DATASEC, FLOAT, DECL_TAG, TYPE_TAG, ENUM64 = range(12, 20)

# bytes that follow the 12-byte common header, per kind: fixed + per-vlen item
_EXTRA = {INT: (4, 0), ARRAY: (12, 0), STRUCT: (0, 12), UNION: (0, 12), ENUM: (0, 8), FUNC_PROTO: (0, 8),
          VAR: (4, 0), DATASEC: (0, 12), DECL_TAG: (4, 0), ENUM64: (0, 12)}
_MODIFIERS = (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG)


class BtfError(Exception):
    """The BTF could not be read, or a member is not where it was looked for."""


@dataclass(frozen=True)
class Member:
    name: str
    type_id: int
    bit_offset: int


@dataclass(frozen=True)
class Type:
    kind: int
    name: str
    ref: int  # size (struct/union/int/enum) or referenced type id
    members: tuple[Member, ...] = ()


class Btf:
    """Types by id (1-based) and struct/union ids by name."""

    def __init__(self, types: list[Type]):
        self.types = types
        self.by_name: dict[str, list[int]] = {}
        for i, t in enumerate(types, start=1):
            if t.kind in (STRUCT, UNION) and t.name:
                self.by_name.setdefault(t.name, []).append(i)

    def get(self, type_id: int) -> Type:
        if not 1 <= type_id <= len(self.types):
            raise BtfError(f"type id {type_id} out of range")
        return self.types[type_id - 1]

    def resolve(self, type_id: int) -> Type:
        """Follow typedefs and qualifiers."""
        for _ in range(32):
            t = self.get(type_id)
            if t.kind not in _MODIFIERS:
                return t
            type_id = t.ref
        raise BtfError(f"type {type_id}: modifier chain too long")

    def struct(self, name: str) -> Type:
        """The complete (non-empty) struct or union called `name`."""
        full = [self.get(i) for i in self.by_name.get(name, []) if self.get(i).members]
        if not full:
            raise BtfError(f"struct {name} not in the kernel's BTF")
        if len({(t.ref, t.members) for t in full}) > 1:
            raise BtfError(f"struct {name} has {len(full)} different definitions")
        return full[0]


def parse(blob: bytes) -> Btf:
    """Parse a raw BTF blob (little- or big-endian)."""
    if len(blob) < 24:
        raise BtfError("BTF blob too short")
    end = "<" if struct.unpack_from("<H", blob, 0)[0] == MAGIC else ">"
    magic, _version, _flags, hdr_len = struct.unpack_from(end + "HBBI", blob, 0)
    if magic != MAGIC:
        raise BtfError("not BTF (bad magic)")
    type_off, type_len, str_off, str_len = struct.unpack_from(end + "IIII", blob, 8)
    types_at, strs_at = hdr_len + type_off, hdr_len + str_off
    if types_at + type_len > len(blob) or strs_at + str_len > len(blob):
        raise BtfError("BTF sections run past the end of the blob")
    strs = blob[strs_at:strs_at + str_len]

    def name(off: int) -> str:
        if off >= len(strs):
            raise BtfError(f"string offset {off} out of range")
        return strs[off:strs.index(b"\0", off)].decode("utf-8", "replace")

    types: list[Type] = []
    pos, stop = types_at, types_at + type_len
    while pos < stop:
        name_off, info, ref = struct.unpack_from(end + "III", blob, pos)
        pos += 12
        kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
        fixed, item = _EXTRA.get(kind, (0, 0))
        members: tuple[Member, ...] = ()
        if kind in (STRUCT, UNION):
            ms = []
            for i in range(vlen):
                m_name, m_type, m_off = struct.unpack_from(end + "III", blob, pos + 12 * i)
                ms.append(Member(name(m_name), m_type, (m_off & 0xFFFFFF) if kflag else m_off))
            members = tuple(ms)
        pos += fixed + item * vlen
        # only struct and union names are looked up: skip decoding the rest
        types.append(Type(kind, name(name_off) if kind in (STRUCT, UNION) else "", ref, members))
    if pos != stop:
        raise BtfError("BTF type section ends inside a type")
    return Btf(types)


def load(path: Path = VMLINUX) -> Btf:
    try:
        return parse(path.read_bytes())
    except OSError as e:
        raise BtfError(f"cannot read {path}: {e.strerror}") from None


def member_offset(btf: Btf, struct_name: str, member: str) -> int:
    """Byte offset of `member` in `struct struct_name`, looking through
    anonymous struct and union members. Bit fields are refused."""
    found = _find(btf, btf.struct(struct_name), member, 0, depth=0)
    if found is None:
        raise BtfError(f"struct {struct_name} has no member {member}")
    if found % 8:
        raise BtfError(f"{struct_name}.{member} is a bit field")
    return found // 8


def _find(btf: Btf, t: Type, member: str, base: int, depth: int) -> int | None:
    if depth > 8:
        return None
    for m in t.members:
        if m.name == member:
            return base + m.bit_offset
        if not m.name:
            inner = btf.resolve(m.type_id)
            if inner.kind in (STRUCT, UNION):
                hit = _find(btf, inner, member, base + m.bit_offset, depth + 1)
                if hit is not None:
                    return hit
    return None


# What inspector.c's fd_fs() reads, as (macro, struct, member).
FD_FS_MEMBERS = (
    ("OFF_TASK_FILES", "task_struct", "files"),
    ("OFF_FILES_FDT", "files_struct", "fdt"),
    ("OFF_FDT_MAX_FDS", "fdtable", "max_fds"),
    ("OFF_FDT_FD", "fdtable", "fd"),
    ("OFF_FILE_INODE", "file", "f_inode"),
    ("OFF_INODE_MODE", "inode", "i_mode"),
    ("OFF_INODE_SB", "inode", "i_sb"),
    ("OFF_INODE_NLINK", "inode", "i_nlink"),
    ("OFF_SB_MAGIC", "super_block", "s_magic"),
    ("OFF_TASK_FS", "task_struct", "fs"),
    ("OFF_FS_PWD", "fs_struct", "pwd"),
    ("OFF_PATH_DENTRY", "path", "dentry"),
)


# This process's offsets (or the BtfError's text) by boot key: see the module doc.
_by_boot: dict[str, dict[str, int] | str] = {}


def boot_key(boot_id: Path = BOOT_ID) -> str:
    """What the running kernel's offsets depend on: this boot, the kernel
    release, and the members asked for (a new member is a new key)."""
    try:
        boot = boot_id.read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{boot} {os.uname().release} {zlib.crc32(repr(FD_FS_MEMBERS).encode()):08x}"


def _read_cache(cache: Path, key: str) -> dict[str, int] | None:
    try:
        doc = json.loads(cache.read_text())
        if doc.get("key") == key and isinstance(doc.get("offsets"), dict):
            return {str(k): int(v) for k, v in doc["offsets"].items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # absent, torn or foreign: parse again
    return None


def _write_cache(cache: Path, key: str, offsets: dict[str, int]) -> None:
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"key": key, "offsets": offsets}))
        os.replace(tmp, cache)
    except OSError:  # not root, or no /run: the process cache still holds them
        tmp.unlink(missing_ok=True)


def fd_fs_offsets(btf: Btf | None = None, *, cache: Path | None = CACHE, boot_id: Path = BOOT_ID) -> dict[str, int]:
    """The offsets fd_fs() needs, as C macros. Raises BtfError when one is
    missing (the caller turns the check off and says why). With `btf` given,
    read from it; else from the running kernel's, once per boot (module
    doc): `cache` None keeps them in this process only."""
    if btf is not None:
        return {macro: member_offset(btf, s, m) for macro, s, m in FD_FS_MEMBERS}
    key = boot_key(boot_id)
    if key not in _by_boot:
        found = _read_cache(cache, key) if cache is not None else None
        if found is None:
            try:
                found = fd_fs_offsets(load())
            except BtfError as e:
                _by_boot[key] = str(e)  # no BTF, or a member missing: the same until the next boot
                raise
            if cache is not None:
                _write_cache(cache, key, found)
        _by_boot[key] = found
    got = _by_boot[key]
    if isinstance(got, str):
        raise BtfError(got)
    return dict(got)
