"""crabd.runtime after the process.py split, without root: /proc parsing,
CRIU scratch clean-up, the standby admission the daemon shares, and the old
import path."""

from __future__ import annotations

import os
import time

from deltacr import StandbyPolicy, StandbyRecord

from crabd.runtime import criu
from crabd.runtime.procfs import cgroup_procs, parse_stat, task_stat, time_namespaces
from crabd.runtime.standby import admit_standby


def test_parse_stat_takes_the_name_between_the_first_and_last_parenthesis():
    st = parse_stat(b"4242 (a) b (c)) T 17 4242 4242 0 -1 4194560 100 0 0 0\n")
    assert (st.comm, st.state, st.ppid) == ("a) b (c)", "T", 17)
    me = task_stat(os.getpid())
    assert me.ppid == os.getppid() and me.state in ("R", "S")


def test_cgroup_procs_and_time_namespaces(tmp_path):
    procs = tmp_path / "cgroup.procs"
    procs.write_text(f"{os.getpid()}\n")
    assert cgroup_procs(procs) == [os.getpid()] and cgroup_procs(tmp_path / "gone") == []
    groups = time_namespaces([os.getpid(), 2 ** 22 + 7])  # the second pid does not exist
    assert sum(len(p) for p in groups.values()) <= 1


def test_gc_scratch_removes_only_old_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(criu, "_TMPFS", tmp_path)
    old, new, other = tmp_path / "crabd-cr-dump-old", tmp_path / "crabd-cr-image-new", tmp_path / "keep-me"
    for d in (old, new, other):
        d.mkdir()
        (d / "pages-1.img").write_bytes(b"x")
    past = time.time() - 7200
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert criu.gc_scratch() == 1
    assert not old.exists() and new.exists() and other.exists()


def test_admit_standby_evicts_only_when_admitted():
    policy = StandbyPolicy(per_sandbox=1, memory_budget=100)
    cur = [StandbyRecord("a", "a-1", 60, 1.0), StandbyRecord("b", "b-1", 30, 2.0)]
    gone: list[str] = []
    adm = admit_standby(policy, StandbyRecord("c", "c-1", 50, 3.0), cur, lambda r: gone.append(r.checkpoint_id))
    assert adm.admit and gone == ["a-1"]
    gone.clear()
    adm = admit_standby(policy, StandbyRecord("c", "c-1", 500, 3.0), cur, lambda r: gone.append(r.checkpoint_id))
    assert not adm.admit and gone == []


def test_the_old_import_path_still_works():
    from crabd.runtime import process
    for name in process.__all__:
        assert getattr(process, name) is not None, name
    assert process._scratch is criu.scratch_dir and process._check_tree is criu._check_tree
