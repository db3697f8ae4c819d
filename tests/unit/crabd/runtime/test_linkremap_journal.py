"""The link-remap journal (crabd/runtime/linkremap.py): what a crash between
making crabd's links and removing them leaves, `recover` removes at start."""

from __future__ import annotations

from crabd.runtime.linkremap import journal, recover, unlink_all


def test_recover_removes_the_links_a_journal_names_and_the_journal(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "root").mkdir(parents=True)
    (rootfs / "root" / "b").write_text("x")
    (rootfs / "root" / ".crabd-link-remap.7").write_text("x")
    (rootfs / "root" / "keep").write_text("x")
    from crabd.runtime import linkremap
    j = journal(tmp_path / "state", "dump-sb-1")
    linkremap._write_journal(j, rootfs, [{"orig": "/root/a", "link": "/root/.crabd-link-remap.7"},
                                         {"orig": "/root/c", "link": "/root/.crabd-link-remap.9"}])  # never made
    assert recover(tmp_path / "state") == 1
    assert sorted(p.name for p in (rootfs / "root").iterdir()) == ["b", "keep"]
    assert not j.exists()
    assert recover(tmp_path / "state") == 0


def test_unlink_all_drops_the_journal(tmp_path):
    j = journal(tmp_path / "state", "dump-sb-1")
    j.parent.mkdir(parents=True)
    j.write_text("{}")
    unlink_all(tmp_path, [{"link": "/gone"}], j)
    assert not j.exists()


def test_recover_without_journals(tmp_path):
    assert recover(tmp_path) == 0


def test_a_sandbox_symlink_on_the_way_is_not_followed(tmp_path):
    # the sandbox made /root a symlink out of its root: the host's file of
    # that name stays (removing through the symlink would leave the sandbox)
    rootfs, outside = tmp_path / "rootfs", tmp_path / "host"
    rootfs.mkdir()
    outside.mkdir()
    (outside / ".crabd-link-remap.7").write_text("host's")
    (rootfs / "root").symlink_to(outside)
    from crabd.runtime import linkremap
    j = journal(tmp_path / "state", "dump-sb-1")
    linkremap._write_journal(j, rootfs, [{"orig": "/root/a", "link": "/root/.crabd-link-remap.7"}])
    assert recover(tmp_path / "state") == 0
    unlink_all(rootfs, [{"link": "/root/.crabd-link-remap.7"}])
    assert (outside / ".crabd-link-remap.7").read_text() == "host's" and not j.exists()
