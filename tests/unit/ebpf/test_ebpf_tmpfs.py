"""The tmpfs check (ebpf._tmpfs): mountinfo parsing, the manifest
comparison, and the scan itself over a fake /proc whose `root` is a plain
directory (no root needed), plus its hook in both inspectors."""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import pytest

from ebpf import Inspector, PlanKind, ProcInspector, classify
from ebpf._tmpfs import HostMemoryFs, Mount, changed_paths, memory_mounts, parse_mountinfo, unknown
from ebpf.testing import FakeClock, FakeLoader, FakeProcessTable

MOUNTINFO = """\
92 49 0:41 /snapshots/3 / rw,noatime - btrfs /dev/loop1 rw
94 92 0:56 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
95 94 0:57 / /dev/pts rw,nosuid - devpts devpts rw
96 94 0:58 / /dev/shm rw,nosuid,nodev - tmpfs shm rw
97 94 0:54 / /dev/mqueue rw - mqueue mqueue rw
100 94 254:0 /var/run/sb/run /dev/.crabd rw - tmpfs tmpfs rw
101 92 0:59 / /work/my\\040dir rw - tmpfs tmpfs rw
"""


def test_mountinfo_memory_mounts_leave_out_other_types_and_outside_paths():
    mounts = parse_mountinfo(MOUNTINFO)
    assert mounts[1] == Mount(94, (0, 56), "/dev", "tmpfs")
    got = [m.mount_point for m in memory_mounts(mounts, ("/dev/.crabd",))]
    assert got == ["/dev", "/dev/shm", "/dev/mqueue", "/work/my dir"]


def test_changed_paths():
    a = {(1, "/dev/shm"): {"": ("d", 1), "x": ("f", 2)}, (1, "/dev"): {"": ("d", 3)}}
    assert changed_paths(a, {k: dict(v) for k, v in a.items()}) == []
    b = {(1, "/dev/shm"): {"": ("d", 1), "x": ("f", 9), "y": ("f", 4)}, (1, "/dev"): {"": ("d", 3)}}
    assert changed_paths(a, b) == ["/dev/shm/x", "/dev/shm/y"]
    assert changed_paths(a, {(1, "/dev"): {"": ("d", 3)}}) == ["/dev/shm"]  # a mount went away
    same_unknown = {(1, "/dev"): {"": unknown("over budget")}}
    assert changed_paths(same_unknown, same_unknown) == ["/dev"]  # unknown never equals
    assert changed_paths({(1, "/dev"): {"": unknown("x")}}, {(1, "/dev"): {"": unknown("x")}}) == ["/dev"]


def fake_sandbox(tmp_path: Path) -> tuple[HostMemoryFs, Path]:
    """A fake /proc/7 whose root is `tmp_path/root`, with one memory mount:
    /dev/shm (a plain directory of the file system `tmp_path` is on)."""
    root = tmp_path / "root"
    shm = root / "dev" / "shm"
    shm.mkdir(parents=True)
    (root / "dev" / ".crabd").mkdir()
    st = os.stat(shm)
    proc = tmp_path / "proc" / "7"
    (proc / "ns").mkdir(parents=True)
    (proc / "ns" / "mnt").write_text("")
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    (proc / "mountinfo").write_text(
        f"1 0 {dev} / /dev/shm rw - tmpfs shm rw\n2 0 {dev} / /dev/.crabd rw - tmpfs tmpfs rw\n"
    )
    (proc / "root").symlink_to(root)
    return HostMemoryFs(proc=str(tmp_path / "proc")), shm


@pytest.fixture
def sandbox(tmp_path):
    return fake_sandbox(tmp_path)


def test_scan_sees_a_write_whatever_path_it_took(sandbox):
    fs, shm = sandbox
    before = fs.manifest([7], ("/dev/.crabd",))
    assert changed_paths(before, fs.manifest([7], ("/dev/.crabd",))) == []
    cwd = os.getcwd()
    try:  # a relative path, as after `cd /dev/shm`
        os.chdir(shm)
        Path("rel.txt").write_text("hello\n")
    finally:
        os.chdir(cwd)
    after = fs.manifest([7], ("/dev/.crabd",))
    assert changed_paths(before, after) == ["/dev/shm", "/dev/shm/rel.txt"]
    # crabd's own directory is not scanned
    (shm.parent / ".crabd" / "status").write_text("0")
    assert changed_paths(after, fs.manifest([7], ("/dev/.crabd",))) == []


def test_scan_sees_content_changed_through_a_mapping():
    """A store into a page already mapped writable moves neither mtime nor
    ctime of a shmem file: only the content digest sees it."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:  # a real tmpfs
        fs, shm = fake_sandbox(Path(d))
        f = shm / "m"
        f.write_bytes(bytes(4096))
        with open(f, "r+b") as fh, mmap.mmap(fh.fileno(), 4096, mmap.MAP_SHARED) as m:
            m[:5] = b"first"
            before, st = fs.manifest([7]), os.stat(f)
            m[:5] = b"mmap!"
            after, st2 = fs.manifest([7]), os.stat(f)
        assert (st.st_mtime_ns, st.st_ctime_ns) == (st2.st_mtime_ns, st2.st_ctime_ns)
        assert changed_paths(before, after) == ["/dev/shm/m"]


def test_scan_never_follows_a_planted_symlink(sandbox, tmp_path):
    fs, shm = sandbox
    outside = tmp_path / "host-secret"
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 100)
    (shm / "evil").symlink_to(outside)
    m = fs.manifest([7])
    entries = next(iter(m.values()))
    assert entries["evil"][-1] == str(outside)  # the link itself, not what it names
    assert not any(k.startswith("evil/") for k in entries)


def test_scan_over_budget_counts_as_changed(sandbox):
    fs, shm = sandbox
    for i in range(5):
        (shm / f"f{i}").write_text("x")
    small = HostMemoryFs(proc=fs._proc, max_entries=3)
    a, b = small.manifest([7]), small.manifest([7])
    assert changed_paths(a, b) == ["/dev/shm"]
    tiny = HostMemoryFs(proc=fs._proc, max_bytes=2)
    assert changed_paths(tiny.manifest([7]), tiny.manifest([7])) == ["/dev/shm"]


def test_a_gone_process_is_not_a_change_its_namespace_is(sandbox):
    fs, shm = sandbox
    before = fs.manifest([7, 99], ("/dev/.crabd",))  # 99 does not exist: left out
    assert changed_paths(before, fs.manifest([7], ("/dev/.crabd",))) == []
    assert changed_paths(before, fs.manifest([], ("/dev/.crabd",))) == ["/dev/shm"]


class StaticMemoryFs:
    """A MemoryFs whose manifest the test sets."""

    def __init__(self) -> None:
        self.state = {(1, "/dev/shm"): {"": ("d", 1)}}
        self.outside: tuple[str, ...] = ()

    def manifest(self, pids, outside=()):
        self.outside = outside
        return {k: dict(v) for k, v in self.state.items()}


CG = "/sys/fs/cgroup/unified/sb"


def test_inspector_reports_a_tmpfs_change_as_fs_proc():
    procs, memfs = FakeProcessTable(), StaticMemoryFs()
    procs.start(CG, 1, ("crabd-init",))
    insp = Inspector(FakeLoader(), processes=procs, clock=FakeClock(), poll_interval=None, memory_fs=memfs)
    insp.watch("sb", CG, init_pid=1, outside_paths=("/dev/.crabd",))
    assert memfs.outside == ("/dev/.crabd",)
    assert classify(insp.end_turn("sb")).kind is PlanKind.SKIP
    memfs.state[(1, "/dev/shm")]["rel.txt"] = ("f", 2)
    e = insp.end_turn("sb")
    assert e.special_writes["tmpfs"].sample == ["/dev/shm/rel.txt (changed in memory)"]
    plan = classify(e)
    assert plan.kind is PlanKind.FS_PROC and "tmpfs" in plan.reasons[0]
    assert classify(insp.end_turn("sb")).kind is PlanKind.SKIP  # compared with the last turn end


def test_fallback_reports_a_tmpfs_change_as_fs_proc():
    procs, memfs = FakeProcessTable(), StaticMemoryFs()
    procs.start(CG, 1, ("crabd-init",))
    insp = ProcInspector(lambda sid: [], processes=procs, clock=FakeClock(), memory_fs=memfs)
    insp.watch("sb", CG, outside_paths=("/dev/.crabd",))
    assert classify(insp.end_turn("sb")).kind is PlanKind.SKIP
    memfs.state[(1, "/dev/shm")][""] = ("d", 2)
    assert classify(insp.end_turn("sb")).kind is PlanKind.FS_PROC


def test_the_watchers_own_mount_namespace_is_not_scanned(sandbox, tmp_path):
    fs, shm = sandbox
    (tmp_path / "proc" / "self" / "ns").mkdir(parents=True)
    os.link(tmp_path / "proc" / "7" / "ns" / "mnt", tmp_path / "proc" / "self" / "ns" / "mnt")  # pid 7 shares it
    assert fs.manifest([7]) == {}


def test_a_failing_scan_counts_as_a_change():
    class Broken(StaticMemoryFs):
        def manifest(self, pids, outside=()):
            raise RuntimeError("boom")

    procs = FakeProcessTable()
    procs.start(CG, 1, ("crabd-init",))
    insp = Inspector(FakeLoader(), processes=procs, clock=FakeClock(), poll_interval=None, memory_fs=Broken())
    insp.watch("sb", CG, init_pid=1)
    for _ in range(2):
        assert classify(insp.end_turn("sb")).kind is PlanKind.FS_PROC
