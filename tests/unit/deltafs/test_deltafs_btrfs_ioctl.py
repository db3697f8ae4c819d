"""Unit tests (no root) for the btrfs ioctl encoding (values checked against linux/btrfs.h on this host)."""

from __future__ import annotations

import struct

import pytest

from deltafs import btrfs


def test_ioctl_numbers_match_the_kernel_header():
    assert btrfs.BTRFS_IOC_SNAP_CREATE_V2 == 0x50009417
    assert btrfs.BTRFS_IOC_SUBVOL_CREATE_V2 == 0x50009418
    assert btrfs.BTRFS_IOC_SNAP_DESTROY_V2 == 0x5000943F


def test_vol_args_v2_layout():
    buf = btrfs.vol_args_v2("tmp.12", fd=7, flags=btrfs.BTRFS_SUBVOL_RDONLY)
    assert isinstance(buf, bytearray) and len(buf) == 4096
    fd, transid, flags = struct.unpack_from("=qQQ", buf, 0)
    assert (fd, transid, flags) == (7, 0, 2)
    assert buf[24:56] == bytes(32)  # the qgroup-inherit union stays zero
    assert buf[56:62] == b"tmp.12" and buf[62] == 0


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 4040, "nul\0"])
def test_vol_args_refuses_bad_names(bad):
    with pytest.raises(ValueError):
        btrfs.vol_args_v2(bad)
