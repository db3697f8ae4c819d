"""ebpf._btf: member offsets from BTF, on hand-built blobs and on the host's."""

from __future__ import annotations

import struct

import pytest

from ebpf import _btf


def _blob(types: list[bytes], strings: bytes) -> bytes:
    body = b"".join(types)
    hdr = struct.pack("<HBBIIIII", _btf.MAGIC, 1, 0, 24, 0, len(body), len(body), len(strings))
    return hdr + body + strings


def _t(name_off: int, kind: int, vlen: int, ref: int, kflag: int = 0) -> bytes:
    return struct.pack("<III", name_off, (kflag << 31) | (kind << 24) | vlen, ref)


def _m(name_off: int, type_id: int, bits: int) -> bytes:
    return struct.pack("<III", name_off, type_id, bits)


# strings: 0 "", 1 "int", 5 "outer", 11 "a", 13 "b", 15 "c", 17 "flag"
STRS = b"\0int\0outer\0a\0b\0c\0flag\0"


def test_member_offsets_through_an_anonymous_union():
    types = [
        _t(1, _btf.INT, 0, 4) + struct.pack("<I", 32),              # 1: int
        _t(0, _btf.UNION, 2, 8) + _m(13, 1, 0) + _m(15, 1, 0),        # 2: union { int b; int c; }
        _t(0, _btf.CONST, 0, 2),                                      # 3: const (2)
        _t(5, _btf.STRUCT, 3, 24, kflag=1) + _m(11, 1, 0) + _m(0, 3, 64) + _m(17, 1, (1 << 24) | 129),
    ]
    b = _btf.parse(_blob(types, STRS))
    assert _btf.member_offset(b, "outer", "a") == 0
    assert _btf.member_offset(b, "outer", "b") == 8
    assert _btf.member_offset(b, "outer", "c") == 8
    with pytest.raises(_btf.BtfError, match="bit field"):
        _btf.member_offset(b, "outer", "flag")
    with pytest.raises(_btf.BtfError, match="no member"):
        _btf.member_offset(b, "outer", "zzz")
    with pytest.raises(_btf.BtfError, match="not in the kernel"):
        _btf.member_offset(b, "inner", "a")


def test_garbage_is_refused():
    with pytest.raises(_btf.BtfError):
        _btf.parse(b"\0" * 40)
    with pytest.raises(_btf.BtfError):
        _btf.parse(_blob([_t(1, _btf.INT, 0, 4)], STRS))  # INT without its 4 bytes


def test_the_running_kernels_offsets():
    # This host's kernel has BTF (CONFIG_DEBUG_INFO_BTF); crabd's inspector needs it.
    offs = _btf.fd_fs_offsets()
    assert set(offs) == {m for m, _s, _f in _btf.FD_FS_MEMBERS}
    assert offs["OFF_PATH_DENTRY"] == 8  # struct path { vfsmount *mnt; dentry *dentry; }
    assert all(v >= 0 for v in offs.values())


def test_the_kernels_offsets_are_parsed_once_per_boot(tmp_path, monkeypatch):
    """The BTF parse takes seconds: a second load in this process, or in a
    later process of the same boot, reads the kept offsets; another boot
    parses again."""
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    cache = tmp_path / "offsets.json"
    parsed: list[int] = []
    blob = _btf.Btf.__new__(_btf.Btf)  # stands for the kernel's BTF: never read by the fake below

    def fake_load(path=_btf.VMLINUX):
        parsed.append(1)
        return blob

    monkeypatch.setattr(_btf, "load", fake_load)
    monkeypatch.setattr(_btf, "member_offset", lambda b, s, m: len(s) + len(m))
    monkeypatch.setattr(_btf, "_by_boot", {})
    first = _btf.fd_fs_offsets(cache=cache, boot_id=boot)
    assert _btf.fd_fs_offsets(cache=cache, boot_id=boot) == first
    assert len(parsed) == 1
    monkeypatch.setattr(_btf, "_by_boot", {})  # a new process of the same boot
    assert _btf.fd_fs_offsets(cache=cache, boot_id=boot) == first
    assert len(parsed) == 1
    boot.write_text("boot-2\n")
    _btf.fd_fs_offsets(cache=cache, boot_id=boot)
    assert len(parsed) == 2


def test_a_missing_member_is_remembered_for_the_boot(tmp_path, monkeypatch):
    boot = tmp_path / "boot_id"
    boot.write_text("boot-1\n")
    calls: list[int] = []

    def no_btf(path=_btf.VMLINUX):
        calls.append(1)
        raise _btf.BtfError("cannot read vmlinux: No such file or directory")

    monkeypatch.setattr(_btf, "load", no_btf)
    monkeypatch.setattr(_btf, "_by_boot", {})
    for _ in range(2):
        with pytest.raises(_btf.BtfError, match="cannot read"):
            _btf.fd_fs_offsets(cache=tmp_path / "c.json", boot_id=boot)
    assert len(calls) == 1
