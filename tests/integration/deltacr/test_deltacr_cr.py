"""deltacr on the real thing: runc 1.1 + CRIU 4.1 in crabd sandboxes (root).

One scenario per test. Each checkpoints a sandbox, changes its state, rolls
back, and checks the state is the checkpoint's: in-memory values, file
contents, pids inside the sandbox, listening sockets. Requires: root, runc,
CRIU (`criu check` passing), overlayfs; the Debian test image for the
Python scenarios. A missing requirement fails with the reason, never skips.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

import deltafs
from deltacr import CriuFailed, CriuUnavailable, ImageCorrupted, ImageStore, StandbyPolicy, check_criu
from deltacr.runc import SubprocessCommandRunner
from deltafs import Mount, mount_all, unmount

pytestmark = pytest.mark.needs("runc", "criu", "overlay", "busybox", "debian-py")

# An HTTP server with an in-memory counter (and, with HEAP_MB, a heap of
# random bytes): GET / -> counter, /inc -> counter + 1, /digest -> blake2 of
# the heap, /mutate -> flip bytes of the heap.
SERVER = r'''
import hashlib, http.server, os, sys
heap = bytearray(os.urandom(int(os.environ.get("HEAP_MB", "0")) << 20))
n = [0]
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/inc":
            n[0] += 1
        if self.path == "/mutate":
            for off in range(0, len(heap), len(heap) // 7 or 1):
                heap[off] ^= 0xFF
        body = (hashlib.blake2b(heap).hexdigest() if self.path == "/digest" else str(n[0])).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", 8080), H).serve_forever()
'''

# Probe from inside the sandbox (it has loopback only); retries while the
# server starts, for up to 60 s: a server drawing a 200 MiB heap from
# os.urandom took longer than the 5 s it had at load ~20 (CI beside other work).
PROBE = r'''
import sys, time, urllib.request
deadline = time.monotonic() + 60
while True:
    try:
        print(urllib.request.urlopen("http://127.0.0.1:8080" + sys.argv[1], timeout=10).read().decode())
        break
    except OSError as e:
        if time.monotonic() > deadline:
            sys.exit(f"probe failed: {e}")
        time.sleep(0.05)
'''

# Processes inside the sandbox as "pid comm", without the lister itself,
# its exec wrapper and its children. Builtins only (no ps in the images).
LIST_PROCS = r'''
for d in /proc/[0-9]*; do
  p=${d#/proc/}
  [ "$p" = "$$" ] && continue
  [ "$p" = "$PPID" ] && continue
  read -r st < "$d/stat" 2>/dev/null || continue
  set -- $st
  [ "$4" = "$$" ] && continue
  read -r c < "$d/comm"
  echo "$p $c"
done
'''


# --- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cr_runtime(runtime):
    from crabd.runtime import Runtime
    from crabd.runtime.process import CheckpointableRunner
    try:
        check_criu(SubprocessCommandRunner(), "criu", ("mnt_id", "seccomp_filters", "ns_pid"))
    except CriuUnavailable as e:
        pytest.fail(f"CRIU is not usable on this host: {e}", pytrace=False)
    # Until Runtime.start gives the init a pipe itself (see crabd.runtime.process).
    return Runtime(runtime.state_dir, runner=CheckpointableRunner())


@pytest.fixture
def store(tmp_path):
    return ImageStore(tmp_path / "cr")


@pytest.fixture
def make_sandbox(cr_runtime):
    from crabd.runtime.process import discard_standby, list_standbys
    made = []

    def make(image, **kw):
        sb = cr_runtime.create(image, **kw)
        made.append(sb.id)
        return sb

    yield make
    for sid in made:
        for st in list_standbys(cr_runtime, sid):
            try:
                discard_standby(cr_runtime, st)
            except Exception:
                pass
        try:
            cr_runtime.destroy(sid)
        except Exception:
            pass


@pytest.fixture(scope="module")
def fs_store(tmp_path_factory, make_busybox_rootfs):
    """A deltafs overlay store holding the busybox image as committed `busybox`."""
    d = tmp_path_factory.mktemp("deltafs")
    s = deltafs.open(str(d / "fs"), driver="overlay")
    src = make_busybox_rootfs(d / "src")
    (src / "data").mkdir()
    mnt = d / "mnt"
    mnt.mkdir()
    mount_all(s.prepare("import"), str(mnt))
    try:
        subprocess.run(["cp", "-a", f"{src}/.", str(mnt)], check=True, timeout=60)
    finally:
        unmount(str(mnt))
    s.commit("busybox", "import")
    yield s
    s.close()


def sh(rt, sb, script, **kw):
    r = rt.exec(sb.id, ["/bin/sh", "-c", script], **kw)
    assert r.exit_code == 0, f"{script!r} failed: {r.stderr}"
    return r.stdout


def probe(rt, sb, path="/"):
    r = rt.exec(sb.id, ["python3", "-c", PROBE, path], timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def procs(rt, sb):
    return sorted(x for x in sh(rt, sb, LIST_PROCS).split("\n") if x)


def start_server(rt, sb, heap_mb=0):
    rt.exec(sb.id, ["/bin/sh", "-c", "cat > /srv.py"], stdin=SERVER)
    sh(rt, sb, f"HEAP_MB={heap_mb} python3 /srv.py </dev/null >/dev/null 2>&1 &")
    assert probe(rt, sb) == "0"


def rollback_fs(rt, sb, snaps, key, name):
    """What crabd's rollback does for the file system: the root becomes a
    fresh active snapshot on top of committed `name`."""
    rt.stop(sb.id)
    unmount(str(sb.rootfs))
    snaps.remove(key)
    mounts = snaps.prepare(key, parent=name)
    mount_all(mounts, str(sb.rootfs))
    sb = rt.get(sb.id)
    sb.root = mounts
    rt._save(sb)


def _reap_orphaned_shells():
    """The detached shell exits at once and is re-parented to this process
    (the runtime makes it a subreaper): reap it, or its zombie would keep
    the sandbox's pid namespace from ever going away."""
    import psutil
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        kids = [c for c in psutil.Process().children() if c.name() == "sh"]
        if kids and all(c.status() == psutil.STATUS_ZOMBIE for c in kids):
            for c in kids:
                os.waitpid(c.pid, 0)
            return
        time.sleep(0.01)


def wait_for(get, expect, timeout=10.0):
    """Poll `get()` until it returns `expect` (or the timeout); return the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = get()
        if v == expect or time.monotonic() > deadline:
            return v
        time.sleep(0.02)


def freezer_state(rt, sb):
    return (rt.layout.freezer_dir(sb.cgroup_rel) / "freezer.state").read_text().strip()


# --- scenarios --------------------------------------------------------------------------------------------
def test_http_server_counter_and_socket_roll_back(cr_runtime, debian_image, make_sandbox, store):
    from crabd.runtime.process import checkpoint_processes, restore_processes
    rt = cr_runtime
    sb = make_sandbox(debian_image)
    start_server(rt, sb)
    probe(rt, sb, "/inc"), probe(rt, sb, "/inc")
    before = procs(rt, sb)
    info = checkpoint_processes(rt, sb.id, store, "http-1")
    assert info.raw_bytes > 0 and info.dump_ms > 0
    assert rt.get(sb.id).status == "running" and freezer_state(rt, sb) == "THAWED"
    assert probe(rt, sb, "/inc") == "3" and probe(rt, sb, "/inc") == "4"

    restore_processes(rt, sb.id, store, "http-1")

    assert rt.get(sb.id).status == "running"
    assert probe(rt, sb) == "2"                # counter of the checkpoint; the socket accepts
    assert procs(rt, sb) == before             # same pids inside the sandbox
    assert probe(rt, sb, "/inc") == "3"        # and it keeps working


def test_shell_pipeline_of_two_processes_rolls_back(cr_runtime, busybox_image, make_sandbox, store, fs_store):
    from crabd.runtime.process import checkpoint_processes, restore_processes
    rt, snaps = cr_runtime, fs_store
    key = f"pipe-{os.getpid()}-{time.monotonic_ns()}"
    sb = make_sandbox(busybox_image, root=snaps.prepare(key, parent="busybox"))
    # Producer counts in its own memory, one number per step; consumer
    # writes the latest to /data/last. A step is a write to the fifo.
    sh(rt, sb, "mkfifo /step")
    sh(rt, sb, "({ i=1; echo $i; while :; do if read _ < /step; then i=$((i+1)); echo $i; fi; done; } | "
               "while read n; do echo $n > /data/last; done) </dev/null >/dev/null 2>&1 &")

    def last():
        return sh(rt, sb, "cat /data/last 2>/dev/null || true").strip()

    def step(expect):
        # One step at a time: a second write could land in the fifo before
        # the reader re-opens it, and be lost.
        sh(rt, sb, "echo > /step")
        assert wait_for(last, expect) == expect

    assert wait_for(last, "1") == "1"
    step("2"), step("3")
    before = procs(rt, sb)
    assert len([p for p in before if p.endswith(" sh")]) >= 2
    info = checkpoint_processes(rt, sb.id, store, "pipe-1", fs_commit=lambda: snaps.checkpoint(key))
    step("4"), step("5")

    rollback_fs(rt, sb, snaps, key, info.fs_result)
    restore_processes(rt, sb.id, store, "pipe-1")

    assert last() == "3"
    assert procs(rt, sb) == before
    step("4")  # the producer's memory was rolled back too: it counts on from 3


def test_file_open_for_writing_rolls_back_with_its_offset(cr_runtime, busybox_image, make_sandbox, store, fs_store):
    from crabd.runtime.process import checkpoint_processes, restore_processes
    rt, snaps = cr_runtime, fs_store
    key = f"file-{os.getpid()}-{time.monotonic_ns()}"
    sb = make_sandbox(busybox_image, root=snaps.prepare(key, parent="busybox"))
    sh(rt, sb, "mkfifo /step")
    sh(rt, sb, "(exec 3>/data/log; i=0; while :; do if read _ < /step; then i=$((i+1)); echo \"line $i\" >&3; fi; done) "
               "</dev/null >/dev/null 2>&1 &")

    def log():
        return sh(rt, sb, "cat /data/log")

    def step(n):
        sh(rt, sb, "echo > /step")
        want = "".join(f"line {i}\n" for i in range(1, n + 1))
        assert wait_for(log, want) == want

    step(1), step(2), step(3)
    before = procs(rt, sb)
    seen = {}

    def fs_commit():
        seen["freezer"] = freezer_state(rt, sb)  # processes must be frozen during the FS commit
        return snaps.checkpoint(key)

    info = checkpoint_processes(rt, sb.id, store, "file-1", fs_commit=fs_commit)
    assert seen["freezer"] == "FROZEN"
    assert freezer_state(rt, sb) == "THAWED"
    step(4), step(5)
    sh(rt, sb, "echo scribble >> /data/other")

    rollback_fs(rt, sb, snaps, key, info.fs_result)
    restore_processes(rt, sb.id, store, "file-1")

    assert log() == "line 1\nline 2\nline 3\n"
    assert sh(rt, sb, "ls /data") == "log\n"
    assert procs(rt, sb) == before
    # The writer's offset came back with the file: line 4 follows line 3, no
    # hole, and its counter came back too.
    step(4)


def test_200mb_heap_rolls_back(cr_runtime, debian_image, make_sandbox, store):
    from crabd.runtime.process import checkpoint_processes, restore_processes
    rt = cr_runtime
    sb = make_sandbox(debian_image)
    start_server(rt, sb, heap_mb=200)
    probe(rt, sb, "/inc")
    digest = probe(rt, sb, "/digest")
    before = procs(rt, sb)
    info = checkpoint_processes(rt, sb.id, store, "heap-1")
    assert info.raw_bytes > 200 << 20
    stats = store.stats()
    assert stats.stored_bytes < info.raw_bytes * 1.1  # random heap: compression cannot help, dedup does not hurt
    probe(rt, sb, "/mutate"), probe(rt, sb, "/inc")
    assert probe(rt, sb, "/digest") != digest

    restore_processes(rt, sb.id, store, "heap-1")

    assert probe(rt, sb, "/digest") == digest
    assert probe(rt, sb) == "1"
    assert procs(rt, sb) == before
    # A second checkpoint of the unchanged heap adds almost nothing to the store.
    checkpoint_processes(rt, sb.id, store, "heap-2")
    assert store.stats().stored_bytes < stats.stored_bytes + (20 << 20)


def test_dump_of_external_unix_socket_fails_with_criu_reason_and_leaves_sandbox_running(
        cr_runtime, busybox_image, make_sandbox, store):
    from crabd.runtime.process import checkpoint_processes
    rt = cr_runtime
    sb = make_sandbox(busybox_image)
    host_end, sandbox_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A process inside the sandbox (a child of its init once the shell
        # exits) whose stdin is a unix socket connected to this host process:
        # a peer CRIU cannot dump. `runc exec --detach` hands the socket over
        # as it is (without --detach runc would put a pipe in between).
        p = subprocess.run([rt.runc_bin, "--root", str(rt.runc_root), "exec", "--detach", sb.id,
                            "/bin/sh", "-c", "exec 3<&0; sleep 1000 <&3 3<&- >/dev/null 2>&1 &"],
                           stdin=sandbox_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
        assert p.returncode == 0
        _reap_orphaned_shells()
        sandbox_end.close()
        before = procs(rt, sb)
        assert any(x.endswith(" sleep") for x in before)
        pids_before = rt.pids(sb.id)

        with pytest.raises(CriuFailed) as ei:
            checkpoint_processes(rt, sb.id, store, "ext-1")

        e = ei.value
        # CRIU's own words (4.1: the peer lives in another network namespace,
        # so the socket is "not found"; other versions say "External socket").
        assert any(re.search(r"[Uu]nix socket .*not found|External socket|ext-unix-sk", ln) for ln in e.errors), e.errors
        assert not any("RLIMIT_NOFILE" in ln for ln in e.errors)
        assert "Error (criu/" in str(e) and "sk-unix" in str(e)
        assert e.log_path and Path(e.log_path).is_file()
        assert Path(e.log_path).parent == store.log_dir("ext-1")
        assert not store.exists("ext-1")
        # The sandbox is intact and running.
        assert rt.get(sb.id).status == "running"
        assert freezer_state(rt, sb) == "THAWED"
        assert rt.pids(sb.id) == pids_before
        assert procs(rt, sb) == before
        host_end.sendall(b"still connected\n")
    finally:
        host_end.close()


def test_corrupted_image_is_refused_and_sandbox_left_alone(cr_runtime, busybox_image, make_sandbox, store):
    from crabd.runtime.process import checkpoint_processes, restore_processes
    rt = cr_runtime
    sb = make_sandbox(busybox_image)
    sh(rt, sb, "sleep 1000 </dev/null >/dev/null 2>&1 &")
    checkpoint_processes(rt, sb.id, store, "bad-1")
    m = store.manifest("bad-1")
    pages = max((f for f in m.files if f.name.startswith("pages-")), key=lambda f: f.size)
    chunk = store._chunk_path(pages.chunks[0][0])
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x55
    chunk.write_bytes(bytes(data))
    pids = rt.pids(sb.id)

    with pytest.raises(ImageCorrupted) as ei:
        restore_processes(rt, sb.id, store, "bad-1")

    assert "bad-1" in str(ei.value)
    assert rt.get(sb.id).status == "running" and rt.pids(sb.id) == pids


def test_hot_standby_promotion_swaps_in_the_checkpoint(cr_runtime, debian_image, make_sandbox, store, tmp_path):
    from crabd.runtime.process import (checkpoint_processes, list_standbys, make_room_for_standby, prepare_standby,
                                       promote_standby)
    rt = cr_runtime
    sb = make_sandbox(debian_image)
    start_server(rt, sb)
    probe(rt, sb, "/inc"), probe(rt, sb, "/inc")
    before = procs(rt, sb)
    checkpoint_processes(rt, sb.id, store, "hot-1")
    # The standby's own root: a fork of the image (an overlay with its own upper).
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir(), work.mkdir()
    (upper / "standby-marker").write_text("fork\n")
    (upper / "srv.py").write_text(SERVER)
    root = [Mount("overlay", "overlay", (f"lowerdir={rt.images.get(debian_image).path}", f"upperdir={upper}",
                                         f"workdir={work}", "index=off"))]
    policy = StandbyPolicy(per_sandbox=1, memory_budget=1 << 30)
    assert make_room_for_standby(rt, policy, sb.id, store, "hot-1").admit
    st = prepare_standby(rt, sb.id, store, "hot-1", root=root)
    assert [s.checkpoint_id for s in list_standbys(rt, sb.id)] == ["hot-1"]
    assert not make_room_for_standby(rt, policy, sb.id, store, "hot-1").admit  # already there
    # Stopped, every task (state T), and outside the sandbox's cgroup.
    standby_pids = [int(x) for x in (rt.layout.freezer_dir(st.cgroup_rel) / "cgroup.procs").read_text().split()]
    assert st.pid in standby_pids and not set(standby_pids) & set(rt.pids(sb.id))
    for pid in standby_pids:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "T", (pid, state)
    assert probe(rt, sb, "/inc") == "3"

    sb2 = promote_standby(rt, st)

    assert sb2.status == "running"
    assert st.promote_ms is not None  # its latency is measured by bench/cr.py, not asserted
    assert probe(rt, sb) == "2"
    assert procs(rt, sb) == before
    assert sh(rt, sb, "ls /standby-marker").strip() == "/standby-marker"  # running on the fork
    # It is the sandbox now: freeze, pids and a further checkpoint work,
    # and that checkpoint leaves it running (no leave-stopped left over).
    assert set(rt.pids(sb.id)) >= {st.pid}
    assert list_standbys(rt, sb.id) == []
    checkpoint_processes(rt, sb.id, store, "hot-2")
    assert probe(rt, sb, "/inc") == "3"


def test_dump_refuses_processes_outside_the_init_tree(cr_runtime, busybox_image, make_sandbox, store):
    """A command still running through exec is not a descendant of the
    sandbox's init: CRIU would silently leave it out, so the dump refuses."""
    from crabd.errors import FailedPrecondition
    from crabd.runtime.process import checkpoint_processes
    rt = cr_runtime
    sb = make_sandbox(busybox_image)
    p = subprocess.Popen([rt.runc_bin, "--root", str(rt.runc_root), "exec", sb.id, "/bin/sleep", "1000"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if any(x.endswith(" sleep") for x in procs(rt, sb)):
                break
            time.sleep(0.02)
        with pytest.raises(FailedPrecondition) as ei:
            checkpoint_processes(rt, sb.id, store, "tree-1")
        assert "sleep" in str(ei.value) and "outside its init" in str(ei.value)
        assert freezer_state(rt, sb) == "THAWED" and not store.exists("tree-1")
    finally:
        p.kill()
        p.wait()
        # runc is gone; its sleep is now this (subreaper) process's child.
        import psutil
        for c in psutil.Process().children():
            if c.name() == "sleep":
                c.kill()
                os.waitpid(c.pid, 0)


def test_rollback_without_process_image_starts_a_fresh_init(cr_runtime, busybox_image, make_sandbox, store):
    from crabd.runtime.process import rollback_processes
    rt = cr_runtime
    sb = make_sandbox(busybox_image)
    sh(rt, sb, "sleep 1000 </dev/null >/dev/null 2>&1 &")
    assert any(p.endswith(" sleep") for p in procs(rt, sb))
    old_pid = rt.get(sb.id).pid

    sb2 = rollback_processes(rt, sb.id, store, None)

    assert sb2.status == "running" and sb2.pid != old_pid
    assert [p for p in procs(rt, sb) if not p.startswith("1 ")] == []


def test_sandbox_whose_init_holds_a_host_file_is_refused_with_the_fix(runtime, busybox_image, sandbox_factory, store):
    """Runtime.start gives the init init.log (a host file) unless the runner
    is CheckpointableRunner: the dump is refused up front, with the fix."""
    from crabd.errors import FailedPrecondition
    from crabd.runtime.process import checkpoint_processes
    sb = sandbox_factory(busybox_image)
    with pytest.raises(FailedPrecondition) as ei:
        checkpoint_processes(runtime, sb.id, store, "stdio-1")
    assert "init.log" in str(ei.value) and "CheckpointableRunner" in str(ei.value)
    assert freezer_state(runtime, sb) == "THAWED"


# A CRIU that SIGKILLs runc and itself when runc starts it for a hot
# standby's restore: the restore killed half-way, as crabd's stall timeout
# kills a hung one. Deterministic: it waits for runc's bind mount of the
# standby's root (`<standby>/runc/<id>/criu-root`, made before the restore's
# CRIU starts and unmounted when the restore ends; runc's CRIU version
# check, before it, runs the real CRIU).
KILLING_CRIU = r"""#!/bin/sh
if ! grep -q "/standbys/{sid}/.*/criu-root " /proc/self/mountinfo; then exec "{real}" "$@"; fi
echo killed > "{log}"
kill -9 $PPID $$
"""


def test_standby_restore_killed_half_way_is_discarded_without_deleting_through_its_mounts(
        cr_runtime, busybox_image, make_sandbox, store, tmp_path, monkeypatch):
    """A standby's restore killed half-way leaves runc's `criu-root` bind of
    the standby's root inside the standby's dir. Before the fix its discard
    checked only bundle/rootfs, then rmtree walked into criu-root and deleted
    the files of the caller's file-system fork (here: the overlay's upper
    dir lost its marker), and the mount stayed behind."""
    from crabd.runtime.process import checkpoint_processes, list_standbys, prepare_standby
    from deltafs.mount import mountinfo
    rt = cr_runtime
    sb = make_sandbox(busybox_image)
    sh(rt, sb, "setsid sh -c 'while :; do sleep 0.2; done' </dev/null >/dev/null 2>&1 &")
    checkpoint_processes(rt, sb.id, store, "half-1")
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir(), work.mkdir()
    (upper / "standby-marker").write_text("fork\n")
    root = [Mount("overlay", "overlay", (f"lowerdir={rt.images.get(busybox_image).path}", f"upperdir={upper}",
                                         f"workdir={work}", "index=off"))]
    real = shutil.which("criu")
    wrapper, log = tmp_path / "criu-killing", tmp_path / "criu-killing.log"
    wrapper.write_text(KILLING_CRIU.replace("{real}", real).replace("{log}", str(log)).replace("{sid}", sb.id))
    wrapper.chmod(0o755)
    monkeypatch.setenv("CRABD_CRIU", str(wrapper))

    with pytest.raises(Exception):
        prepare_standby(rt, sb.id, store, "half-1", root=root)

    assert log.is_file(), "the wrapper killed nothing: the restore was not cut half-way"
    mine = str((rt.state_dir / "standbys" / sb.id).resolve())
    assert [m.target for m in mountinfo() if m.target.startswith(mine + "/")] == []
    assert (upper / "standby-marker").read_text() == "fork\n", "the discard deleted through runc's criu-root"
    assert not list(upper.glob("bin")), "whiteouts: files of the fork were deleted through a mount"
    assert list_standbys(rt, sb.id) == []
    assert not (rt.state_dir / "standbys" / sb.id).exists()
    # the sandbox itself is untouched and still runs its loop
    assert "while" in sh(rt, sb, "ps -o args")
