#!/usr/bin/env python3
"""Hostile sandboxes: what a sandbox can put in its own files and processes,
and whether crabd's checkpoint, diff, rollback and fork stay inside it.

    python -m bench.hostile [--quick] [--json] [--files N] [--disk-mib N]
    (or: crabd bench hostile ...)

A real daemon (busybox image) runs on a fresh state directory whose btrfs
loop pool (`[snapshot] pool_size_gib`) is --disk-mib MiB (quick 1536, full
16384): that pool is every sandbox's disk (there is no per-sandbox quota),
so filling it is bounded and harms nothing else on the host.

From inside sandbox `hostile` (one exec, a normal turn):
- symlinks to a host canary directory: absolute, `../../..`-relative, to `/`,
  a symlink loop, one whose name holds a newline;
- hard links inside the sandbox (a hard link to a host path cannot be made:
  the host's link(2) into the sandbox root is tried and must fail with EXDEV);
- `..`-looking names (`...`, `.. `, `..\\n`), names with a newline, names that
  are not UTF-8 (files and a directory);
- a fifo, device nodes (mknod c 1 3, c 1 1 = /dev/mem, b 7 0 = a loop disk),
- a sparse file of 1 TiB apparent size with data at its end,
- `--files` small files (quick 20k, full 1M) in a wide directory (--wide
  2000 subdirectories) and a --deep 1200-level directory chain (deeper than
  the default 1024 open files: a walk holding one fd per level fails).
Then: checkpoint, diff (initial -> hostile), rollback to the initial state
and back to the hostile one, fork of the hostile checkpoint; the content is
checked from inside (1 TiB apparent size, small allocation, fifo still a
fifo, symlinks still symlinks with the same target text, file counts).

A fork bomb runs in sandbox `bomb` (pids limit 64); a disk filler in sandbox
`filler` writes until ENOSPC. Meanwhile a guard thread keeps calling the API
for sandbox `bystander` (health + an exec that writes a file, so the file system store is used):
every call must answer (a call that
takes longer than --guard-s seconds is reported as "blocked").

Host canary: a directory outside the state dir that the symlinks point at,
watched with inotify (open, access, modify, attrib, create, delete, move)
and compared by content, size, mtime and ctime before/after; a self-check
first proves that a host read of the canary is detected. Its file has a
distinctive size and its directory a random file name: neither may appear
in any diff or inside a fork.

Measured: durations of each phase (client wall time), diff response size,
daemon RSS (sampled every 0.2 s: peak per phase), guard latencies.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import hashlib
import json
import os
import secrets
import shutil
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench.harness import RssSampler, report, require_root
from crabd.client import Client
from crabd.errors import CrabdError
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, ensure_busybox_image, settled_checkpoints

ROOT = Path(__file__).resolve().parent.parent

CANARY_SIZE = 31337  # distinctive: must never show up as the size of anything in a diff
IN_ALL = 0xFFF       # IN_ACCESS .. IN_MOVE_SELF


# --- host canary ------------------------------------------------------------------------
class Canary:
    """A host directory the sandbox's symlinks point at, watched with inotify
    and fingerprinted (content digest, size, mtime, ctime of every entry)."""

    def __init__(self, parent: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="crabd-canary-", dir=parent))
        self.token = "CANARY-" + secrets.token_hex(6)
        (self.dir / "secret").write_bytes(b"s" * CANARY_SIZE)
        (self.dir / self.token).write_text("a name that must not appear in any diff\n")
        (self.dir / "sub").mkdir()
        (self.dir / "sub" / "inner").write_text("inner\n")
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for p in (self.dir, self.dir / "sub"):
            if self._libc.inotify_add_watch(self.fd, str(p).encode(), IN_ALL) < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {p}")
        self.before = self.fingerprint()

    def fingerprint(self) -> dict[str, tuple[Any, ...]]:
        out = {}
        for p in sorted([self.dir, *self.dir.rglob("*")]):
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            out[str(p.relative_to(self.dir))] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, digest)
        return out

    def events(self) -> list[tuple[int, str]]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                _wd, mask, _cookie, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16:i + 16 + n].rstrip(b"\0").decode("utf-8", "replace")
                out.append((mask, name))
                i += 16 + n

    def self_check(self) -> dict[str, Any]:
        """A host read of the canary must be seen; the fingerprint must catch a touch."""
        self.events()
        (self.dir / "secret").read_bytes()
        seen = self.events()
        fp = self.fingerprint()
        os.utime(self.dir / "sub" / "inner")
        touched = self.fingerprint() != fp
        self.before = self.fingerprint()
        self.events()  # the fingerprint's own reads
        return {"read_detected": bool(seen), "touch_detected": touched}

    def close(self) -> None:
        os.close(self.fd)
        shutil.rmtree(self.dir, ignore_errors=True)


# --- daemon RSS and the responsiveness guard ----------------------------------------------
class Guard(threading.Thread):
    """Keeps calling the API for another sandbox while a hostile phase runs."""

    def __init__(self, socket: Path, sid: str, limit_s: float) -> None:
        super().__init__(daemon=True)
        self.client = Client(socket, timeout=limit_s)
        self.sid, self.limit_s = sid, limit_s
        self.lat: list[float] = []
        self.errors: list[str] = []
        self.blocked: list[str] = []
        self.stop_ev = threading.Event()

    def run(self) -> None:
        while not self.stop_ev.is_set():
            for name, call in (("health", self.client.health),
                               ("exec", lambda: self.client.exec(self.sid, "echo $$ > /root/guard", timeout=self.limit_s))):
                t = time.monotonic()
                try:
                    call()
                except CrabdError as e:
                    # A timeout of the client is a blocked daemon; an API error is an answer.
                    (self.blocked if "timed out" in str(e).lower() or "cannot reach" in str(e) else
                     self.errors).append(f"{name}: {str(e)[:200]}")
                self.lat.append(time.monotonic() - t)
            self.stop_ev.wait(1.0)

    def report(self) -> dict[str, Any]:
        return {"calls": len(self.lat), "max_s": round(max(self.lat), 3) if self.lat else None,
                "blocked": self.blocked[:5], "errors": self.errors[:5]}


# --- the sandbox's hostile content ---------------------------------------------------------
def hostile_script(canary: str, files: int, deep: int, wide: int) -> str:
    per_dir = max(1, files // wide)
    return f"""
set -e
mkdir -p /root/h && cd /root/h
ln -s {canary}/secret abs_file
ln -s {canary} abs_dir
ln -s ../../../../../../../../../..{canary}/secret rel_file
ln -s ../../../../../../../../../..{canary} rel_dir
ln -s / root_link
ln -s loop loop
ln -s {canary}/secret "$(printf 'nl\\nlink')"
echo hardlinked > hl_a; ln hl_a hl_b; ln hl_a hl_c
touch ... ".. " "$(printf '..\\n.')" "$(printf 'new\\nline')" "$(printf 'bad\\377\\376name')"
mkdir "$(printf 'dir\\377')" && echo x > "$(printf 'dir\\377')/inside"
mkdir '....' && ln -s ../../{canary} '....'/up
mkfifo fifo
mknod null_c c 1 3 && mknod mem_c c 1 1 && mknod loop_b b 7 0 && echo mknod=ok || echo mknod=refused
truncate -s 1099511627776 huge
echo tail | dd of=huge bs=1048576 seek=1048575 conv=notrunc 2>/dev/null
mkdir wide && cd wide
awk 'BEGIN{{for(d=1;d<={wide};d++) print d}}' | xargs mkdir
awk 'BEGIN{{for(d=1;d<={wide};d++) for(f=1;f<={per_dir};f++) print d"/"f}}' | xargs touch
cd /root/h && mkdir deep && cd deep
i=0; while [ $i -lt {deep} ]; do mkdir d; cd d; i=$((i+1)); done
echo bottom > f
echo done
"""


# What a check from inside prints; the same for the original, a rollback and a fork.
PROBE = r"""
cd /root/h || exit 1
echo "huge_size=$(stat -c %s huge)"
echo "huge_blocks=$(stat -c %b huge)"
echo "huge_tail=$(dd if=huge bs=1048576 skip=1048575 count=1 2>/dev/null | head -c 4)"
echo "fifo=$(stat -c %F fifo)"
echo "null_c=$(stat -c %F:%t:%T null_c 2>/dev/null)"
echo "loop_b=$(stat -c %F:%t:%T loop_b 2>/dev/null)"
echo "abs_file=$(readlink abs_file)"
echo "rel_dir=$(readlink rel_dir)"
echo "abs_file_readable=$(cat abs_file >/dev/null 2>&1 && echo yes || echo no)"
echo "hl_links=$(stat -c %h hl_a)"
echo "hl_same=$([ hl_a -ef hl_c ] && echo yes || echo no)"
echo "nonutf8=$(find . -maxdepth 1 -name "$(printf 'bad\377')*" | wc -l)"
echo "nl_names=$(find . -maxdepth 1 -name 'new?line' -exec echo \; | wc -l)"
echo "wide_files=$(find wide -type f | wc -l)"
echo "deep_levels=$(find deep -type d | wc -l)"
echo "deep_bottom=$(cat deep/$(i=1; p=d; while [ $i -lt $1 ]; do p=$p/d; i=$((i+1)); done; echo $p)/f)"
"""


def probe(c: Client, sid: str, deep: int) -> dict[str, str]:
    r = c.exec(sid, ["sh", "-c", PROBE, "probe", str(deep)], timeout=1800)
    out = {}
    for line in r["stdout"].splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k] = v
    return out


def expected_probe(canary: Canary, files: int, deep: int, wide: int) -> dict[str, str]:
    return {"huge_size": str(1 << 40), "huge_tail": "tail", "fifo": "fifo",
            "null_c": "character special file:1:3", "loop_b": "block special file:7:0",
            "abs_file": f"{canary.dir}/secret", "rel_dir": f"../../../../../../../../../..{canary.dir}",
            "abs_file_readable": "no", "hl_links": "3", "hl_same": "yes", "nonutf8": "1", "nl_names": "1",
            "wide_files": str(wide * max(1, files // wide)), "deep_levels": str(deep + 1), "deep_bottom": "bottom"}


def compare(got: dict[str, str], want: dict[str, str], where: str, problems: list[str]) -> None:
    for k, v in want.items():
        if got.get(k) != v:
            problems.append(f"{where}: {k} = {got.get(k)!r}, expected {v!r}")
    blocks = int(got.get("huge_blocks") or 0)
    if blocks * 512 > 64 << 20:
        problems.append(f"{where}: the 1 TiB sparse file allocates {blocks * 512} bytes (copied densely?)")


# --- a state dir whose btrfs pool is small ------------------------------------------------------
def make_state(workdir: str, mib: int, driver: str = "btrfs") -> tuple[Path, Path, Path]:
    """A fresh state dir (on the host's file system, as by default) and a
    config whose btrfs loop pool is `mib` MiB: every sandbox's disk."""
    base = Path(tempfile.mkdtemp(prefix="crabd-hostile-", dir=workdir))
    state = base / "state"
    state.mkdir(mode=0o700)
    cfg = base / "crabd.toml"
    cfg.write_text(f"[snapshot]\ndriver = \"{driver}\"\npool_size_gib = {mib / 1024}\n")
    return base, state, cfg


def wait_committed(c: Client, sid: str, timeout: float = 1800) -> list[dict[str, Any]]:
    cks = settled_checkpoints(c, sid, timeout, all=False)
    if not all(k["state"] == "committed" for k in cks):
        raise SystemExit(f"checkpoints of {sid} not all committed: {cks[-3:]}")
    return cks


class Phases:
    def __init__(self, rss: RssSampler) -> None:
        self.rss = rss
        self.out: dict[str, dict[str, Any]] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t = time.monotonic()
        try:
            res = fn()
            err = None
        except CrabdError as e:
            res, err = None, f"{type(e).__name__}: {e}"
        self.out[name] = {"s": round(time.monotonic() - t, 3),
                          "daemon_rss_peak_mib": round(self.rss.peak_since(t) / 2**20, 1)}
        if err:
            self.out[name]["error"] = err
        return res


def fill_disk(c: Client, ph: "Phases", by: str, problems: list[str], out: dict[str, Any]) -> None:
    """A sandbox writes until ENOSPC; then: errors say so, the daemon answers,
    destroying the filler frees the space, checkpoints work again."""
    fill = c.create_sandbox("busybox", name="filler")["id"]
    fd: dict[str, Any] = {}
    r = ph.run("fill_disk", lambda: c.exec(fill, "dd if=/dev/zero of=/root/fill bs=1048576 2>&1; "
                                                 "echo written=$(stat -c %s /root/fill)", timeout=1800))
    # The command ran; recording its turn needs room in crabd's own
    # database on the same file system: a clear "disk full" or the turn.
    fd["fill_exec"] = ph.out["fill_disk"].get("error") or f"exit {r and r['exit_code']}"
    w = c.exec(by, "echo x > /root/x 2>&1; echo rc=$?") if not ph.out["fill_disk"].get("error") else None
    fd["bystander_write_when_full"] = w["stdout"].strip()[-200:] if w else "not tried"
    ph.run("checkpoint_when_full", lambda: c.create_checkpoint(by))
    fd["checkpoint_when_full"] = ph.out["checkpoint_when_full"].get("error", "ok")[:300]
    fd["health_when_full"] = c.health()["ok"]
    if fd["health_when_full"] is not True:
        problems.append("daemon unhealthy with a full state file system")
    for k in ("fill_exec", "checkpoint_when_full"):
        e = fd[k]
        if e.startswith("CrabdError") and "disk_full" not in e and "full" not in e:
            problems.append(f"{k}: an error that does not say the disk is full: {e}")
    # Freeing: destroying the sandbox that filled it (a rm inside it would
    # free nothing its checkpoints still hold).
    ph.run("destroy_filler", lambda: c.delete_sandbox(fill))
    fd["destroy_filler"] = ph.out["destroy_filler"].get("error", "ok")
    if fd["destroy_filler"] != "ok":
        problems.append(f"destroying the sandbox that filled the disk failed: {fd['destroy_filler']}")
    # btrfs returns a deleted subvolume's blocks in the background (its
    # cleaner thread): measure how long until the bystander can write.
    t_free, deadline = time.monotonic(), time.monotonic() + 120
    while True:
        try:
            got = c.exec(by, "rm -f /root/x; echo y > /root/y 2>&1 && echo ok")["stdout"].strip()
        except CrabdError as e:
            got = str(e)
        if got == "ok":
            break
        if time.monotonic() > deadline:
            problems.append(f"no space back 120 s after destroying the filler: {got[-200:]}")
            break
        time.sleep(0.5)
    fd["space_back_s"] = round(time.monotonic() - t_free, 2)
    ck = ph.run("checkpoint_after_free", lambda: c.create_checkpoint(by))
    fd["checkpoint_after_free"] = ck["state"] if ck else ph.out["checkpoint_after_free"].get("error")
    if fd["checkpoint_after_free"] != "committed":
        problems.append(f"checkpoints do not work again after freeing space: {fd['checkpoint_after_free']}")
    out["disk_fill"] = fd


# --- the run ----------------------------------------------------------------------------------
def run(a: argparse.Namespace) -> dict[str, Any]:
    files = a.files or (20_000 if a.quick else 1_000_000)
    disk_mib = a.disk_mib or (1536 if a.quick else 16384)
    deep, wide = a.deep, a.wide
    problems: list[str] = []
    base, state, cfg = make_state(a.workdir, disk_mib, a.driver)
    canary = Canary(a.workdir)
    d = DaemonHandle(state, args=["--config", str(cfg)])
    d.log = base / "daemon.log"  # not on the state file system, which this run fills
    out: dict[str, Any] = {"mode": "quick" if a.quick else "full", "files": files, "deep": deep, "wide": wide,
                           "driver": a.driver,
                           "sandbox_disk": f"btrfs loop pool of {disk_mib} MiB" if a.driver == "btrfs" else
                           f"overlay upper dirs on {a.workdir}'s file system (not filled)"}
    try:
        ensure_busybox_image(Runtime(state))
        d.start()
        assert d.proc is not None
        rss = RssSampler(d.proc.pid)
        rss.start()
        ph = Phases(rss)
        c = Client(d.socket)
        out["canary_self_check"] = sc = canary.self_check()
        if not all(sc.values()):
            problems.append(f"canary self-check failed: {sc}")
        by = c.create_sandbox("busybox", name="bystander")["id"]
        guard = Guard(d.socket, by, a.guard_s)
        guard.start()

        # 1. hostile content, then checkpoint / diff / rollback / fork
        sid = c.create_sandbox("busybox", name="hostile")["id"]
        ck0 = f"{sid}-0"
        r = ph.run("create_content", lambda: c.exec(sid, ["sh", "-c", hostile_script(str(canary.dir), files, deep, wide)],
                                                     timeout=3600))
        if r is None or r["exit_code"] != 0:
            problems.append(f"creating the hostile content failed: {r and r['stderr'][-500:]}")
        out["mknod_inside"] = "refused" if r and "mknod=refused" in r["stdout"] else "ok"
        ph.run("turn_capture", lambda: wait_committed(c, sid))
        ck = ph.run("checkpoint", lambda: c.create_checkpoint(sid))
        for k in c.checkpoints(sid, all=True):
            if k["state"] != "committed":
                problems.append(f"checkpoint {k['id']} is {k['state']}: {str(k.get('error'))[:400]}")
        ck_id = ck["id"] if ck else r["checkpoint"]
        # A hard link from the host into the sandbox's root: refused across file systems.
        rootfs = Runtime(state).get(sid).rootfs
        try:
            os.link(canary.dir / "secret", rootfs / "root" / "h" / "host_hardlink")
            out["host_hardlink"] = "created"
            problems.append("a hard link from the host canary into the sandbox root could be made")
        except OSError as e:
            out["host_hardlink"] = f"refused: {os.strerror(e.errno or 0)}"
        want = expected_probe(canary, files, deep, wide)
        compare(probe(c, sid, deep), want, "original", problems)

        diff = ph.run("diff", lambda: c.diff(ck0, ck_id, limit=10**6))
        short = ph.run("diff_default_limit", lambda: c.diff(ck0, ck_id))
        if short is not None and (len(short["changes"]) > 10_000 or
                                  short["truncated"] != (short["total"] > 10_000)):
            problems.append(f"diff limit not applied: {len(short['changes'])} of {short['total']}")
        if diff is not None:
            raw = json.dumps(diff)
            out["diff"] = {"changes": diff["total"], "json_bytes": len(raw),
                           "default_limit_returns": len(short["changes"]) if short else None}
            if canary.token in raw:
                problems.append("the canary directory's listing leaked into a diff")
            for ch in diff["changes"]:
                if ch.get("size") == CANARY_SIZE:
                    problems.append(f"diff entry {ch['path']!r} has the canary's size: a symlink was followed")
                if ch["path"].startswith("root/h/") and ch["path"][7:] in ("abs_file", "abs_dir", "rel_file",
                                                                            "rel_dir", "root_link") \
                        and ch["type"] != "symlink":
                    problems.append(f"diff says {ch['path']} is a {ch['type']}, not a symlink")
            names = {base64.b64decode(ch["path_b64"]) if "path_b64" in ch else ch["path"].encode()
                     for ch in diff["changes"]}
            for n in (b"root/h/bad\xff\xfename", b"root/h/dir\xff/inside", b"root/h/new\nline"):
                if n not in names:
                    problems.append(f"diff lost the name {n!r} (non-UTF-8 or newline names must round-trip)")
        else:
            problems.append(f"diff failed: {ph.out['diff'].get('error')}")

        ph.run("rollback_to_initial", lambda: c.rollback(sid, ck0))
        r = c.exec(sid, "ls /root/h 2>&1 | head -1")
        if "No such file" not in r["stdout"]:
            problems.append(f"after rollback to {ck0}, /root/h still exists: {r['stdout']!r}")
        ph.run("rollback_to_hostile", lambda: c.rollback(sid, ck_id))
        compare(probe(c, sid, deep), want, "rollback", problems)
        fk = ph.run("fork", lambda: c.fork(ck_id))
        if fk:
            compare(probe(c, fk["sandboxes"][0], deep), want, "fork", problems)
        ph.run("delete_fork", lambda: fk and c.delete_sandbox(fk["sandboxes"][0]))

        # 2. fork bomb in a sandbox with a small pids limit
        bomb = c.create_sandbox("busybox", name="bomb", limits={"pids": 64, "memory_bytes": 256 << 20})["id"]
        pids_file = Path(f"/sys/fs/cgroup/pids/crabd/{bomb}/pids.current")
        peak = [0]
        stop_pids = threading.Event()

        def watch_pids() -> None:
            while not stop_pids.is_set():
                try:
                    peak[0] = max(peak[0], int(pids_file.read_text()))
                except (OSError, ValueError):
                    pass
                stop_pids.wait(0.05)

        wt = threading.Thread(target=watch_pids, daemon=True)
        wt.start()
        r = ph.run("fork_bomb", lambda: c.exec(bomb, ["sh", "-c", "b(){ b | b & }; b; sleep 3; echo survived"],
                                               timeout=20))
        stop_pids.set()
        wt.join()
        events = Path(f"/sys/fs/cgroup/pids/crabd/{bomb}/pids.events")
        out["fork_bomb"] = {"pids_limit": 64, "pids_peak": peak[0] if pids_file.exists() else None,
                            "pids_events": events.read_text().strip() if events.exists() else None,
                            "fork_failures_in_stderr": r["stderr"].count("fork") if r else None,
                            "exec": ph.out["fork_bomb"].get("error", "returned")[:300]}
        after = ph.run("exec_in_bombed", lambda: c.exec(bomb, "echo hi", timeout=30))
        out["fork_bomb"]["exec_after"] = (ph.out["exec_in_bombed"].get("error") or
                                          f"exit {after and after['exit_code']}: {after and after['stderr'][:200]}")
        ph.run("bomb_rollback", lambda: c.rollback(bomb, f"{bomb}-0"))
        r = c.exec(bomb, "echo ok")
        out["fork_bomb"]["after_rollback"] = r["stdout"].strip()
        if r["stdout"].strip() != "ok":
            problems.append(f"bombed sandbox not usable after rollback: {r}")
        if out["fork_bomb"]["pids_peak"] is None or out["fork_bomb"]["pids_peak"] > 64:
            problems.append(f"pids limit not seen holding: peak {out['fork_bomb']['pids_peak']}")

        # 3. fill the disk (no per-sandbox quota: the state file system is shared)
        if a.driver == "btrfs":
            fill_disk(c, ph, by, problems, out)

        guard.stop_ev.set()
        guard.join(a.guard_s + 5)
        out["guard"] = g = guard.report()
        if g["blocked"]:
            problems.append(f"the daemon did not answer the bystander within {a.guard_s} s: {g['blocked']}")
        if c.health()["ok"] is not True:
            problems.append("daemon unhealthy at the end")
        rss.stop_ev.set()
        out["phases"] = ph.out
        out["daemon_rss_peak_mib"] = round(max(r for _, r in rss.samples) / 2**20, 1)
        for sb in c.sandboxes():
            c.delete_sandbox(sb["id"])
    except BaseException:
        print(f"--- crabd (exit {d.proc and d.proc.poll()}) log tail:\n{d.log.read_text(errors='replace')[-4000:]}",
              file=sys.stderr)
        raise
    finally:
        if d.proc is not None and d.proc.poll() is not None:
            problems.append(f"crabd exited with {d.proc.returncode} during the run")
            out["daemon_log_tail"] = d.log.read_text(errors="replace")[-3000:]
            print(out["daemon_log_tail"], file=sys.stderr)
        d.stop()
        time.sleep(0.5)
        ev = canary.events()
        try:
            changed = canary.fingerprint() != canary.before
        except OSError:  # gone (deleted from outside, or by a sandbox through crabd)
            changed = True
        out["canary"] = {"events": len(ev), "changed": changed,
                         "first_events": [f"{m:#x}:{n}" for m, n in ev[:5]]}
        if ev:
            problems.append(f"host canary accessed: {out['canary']['first_events']}")
        if out["canary"]["changed"]:
            problems.append("host canary changed (content, size, mtime or ctime)")
        canary.close()
        cleanup_state_dir(state)
        if not os.environ.get("CRABD_BENCH_KEEP"):
            shutil.rmtree(base, ignore_errors=True)
    out["problems"] = problems
    out["ok"] = not problems
    return out


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="20k files, 1.5 GiB disk (the CI size)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--files", type=int, default=None, help="small files (default: full 1000000, quick 20000)")
    ap.add_argument("--disk-mib", type=int, default=None, help="size of the state file system (full 16384)")
    ap.add_argument("--driver", choices=["btrfs", "overlay"], default="btrfs",
                    help="deltafs driver; overlay keeps sandbox files on --workdir's file system, so no disk fill")
    ap.add_argument("--wide", type=int, default=2000, help="subdirectories of the wide directory")
    ap.add_argument("--deep", type=int, default=1200, help="levels of the deep directory chain (> 1024 fds)")
    ap.add_argument("--guard-s", type=float, default=120.0, help="an API call slower than this = blocked")
    ap.add_argument("--workdir", default="/var/tmp")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    require_root("bench hostile needs root (it runs a crabd daemon)")
    return report(run(a), a.json)


if __name__ == "__main__":
    sys.exit(main())
