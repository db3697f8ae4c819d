#!/usr/bin/env python3
"""Chaos benchmark: kill -9 crabd at seeded random instants inside its
critical phases, restart it, and check that nothing was lost or leaked.

    python -m bench.chaos [--quick] [--json] [--seed N] [--runs N] [--drivers btrfs,overlay]

(wired to `crabd bench chaos`). Needs root, runc, CRIU, busybox.

How a kill is aimed: the daemon runs with CRABD_CHAOS=<phase> (see
`deltafs.snapshotter.chaos_point`): when it enters that phase it writes
"crabd-chaos: <phase>" to its log and sleeps CRABD_CHAOS_SLEEP seconds; this
script watches the log and sends SIGKILL after a seeded random delay in
[0, sleep + 0.4 s), so the kill lands inside the phase or in the steps right
after it. Phases and where they sit:

    fs_commit   FS checkpoint: sandbox frozen, before the deltafs commit
    criu_dump   FS_PROC checkpoint: frozen, files committed, before the CRIU dump
    compaction  overlay layer merge (idle maintenance or a prepare), before the merge
    rollback    rollback: old init stopped, before the root swap and restart
    fork        fork: new sandbox's runtime entry made, before it starts

Workload: per driver, sandbox A (plain; its turns are FS) and sandbox B
(a background loop, so its turns are FS_PROC). Every write turn prints a
digest of /data (`cat /data/* | md5sum`), recorded for the checkpoint the
turn made. After each restart: every sandbox known must be listed and exec
must work in it; every checkpoint seen committed before the kill must still
be listed committed; the newest committed checkpoints (and, at the end,
every one recorded) are rolled back to and their digest compared; mounts,
runc containers, cgroups and standbys that belong to no listed sandbox are
counted as leaks. At the end every sandbox is destroyed, the daemon stops,
and whatever is still mounted, running, or left in deltafs is a leak.

Output (--json): {"runs", "kills", "lost_sandboxes", "lost_checkpoints",
"corrupt_accepted", "unrestorable_checkpoints", "leaked_mounts",
"leaked_cgroups", "leaked_standbys", "leaked_containers", "leaked_snapshots",
"unusable_sandboxes", "missed", "per_phase", "verified_checkpoints", ...};
all counters but runs/kills/verified should be 0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from crabd.client import Client
from crabd.errors import CrabdError
from crabd.testing import DaemonHandle, all_settled, cleanup_state_dir, ensure_busybox_image

PHASES = {"btrfs": ["fs_commit", "criu_dump", "rollback", "fork"],
          "overlay": ["fs_commit", "criu_dump", "compaction", "rollback", "fork"]}
SLEEP = 0.3
DIGEST = "cat /data/* 2>/dev/null | md5sum"
CGROUP = Path("/sys/fs/cgroup")


def new_state(driver: str, base: str) -> Path:
    from crabd.runtime import Runtime
    st = Path(tempfile.mkdtemp(prefix=f"crabd-chaos-{driver}-", dir=base))
    ensure_busybox_image(Runtime(st), extra_dirs=("data",))
    return st


def write_config(st: Path, driver: str, capture: str) -> Path:
    p = st / "config.toml"
    p.write_text(f'capture = "{capture}"\n[snapshot]\ndriver = "{driver}"\n'
                 '[retention]\nkeep_last = 100000\nkeep_every = 0\n')
    return p


def reap_orphans(keep: int | None) -> int:
    """Reap zombie children of this process except `keep` (the daemon).

    Sandbox inits are children of crabd (a child subreaper); when crabd is
    killed they are re-parented to the nearest subreaper -- this process
    (Runtime() made it one) -- and one that exits later stays a zombie that
    runc still reports as running. Under systemd PID 1 reaps them."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == keep:
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            try:
                os.waitpid(int(d.name), os.WNOHANG)
                n += 1
            except ChildProcessError:
                pass
    return n


_KEEP: list[int | None] = [None]  # the current daemon's pid: its Popen reaps it


def start_reaper() -> threading.Event:
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.2):
            reap_orphans(_KEEP[0])

    threading.Thread(target=loop, daemon=True).start()
    return stop


class Chaos:
    def __init__(self, driver: str, state: Path, rng: random.Random, out: dict[str, Any], log: Any) -> None:
        self.driver, self.state, self.rng, self.out, self.say = driver, state, rng, out, log
        self.d: DaemonHandle | None = None
        self.sandboxes: dict[str, bool] = {}      # id -> has a background process
        self.digests: dict[str, tuple[str, str]] = {}  # checkpoint -> (sandbox, digest of /data)
        self.ever: set[str] = set()               # every sandbox id ever seen in the state dir
        self.n = 0
        self.verify_cap = 0  # at the end verify every recorded checkpoint (0) or a seeded sample of N

    # --- daemon ---------------------------------------------------------------------------
    def start(self, phase: str | None) -> Client:
        reap_orphans(None)
        # The /proc inspector: compiling the BPF program costs ~20 s per start on a loaded host.
        env = {"CRABD_CHAOS": phase or "", "CRABD_CHAOS_SLEEP": str(SLEEP), "CRABD_OVERLAY_MAX_DEPTH": "3",
               "CRABD_INSPECTOR": "proc"}
        # The /proc inspector never plans FS_PROC: aiming at a CRIU dump, the
        # daemon runs in capture mode full (every turn dumps its processes).
        cfg = write_config(self.state, self.driver, "full" if phase == "criu_dump" else "auto")
        self.d = DaemonHandle(self.state, args=["--config", str(cfg)], env=env)
        _KEEP[0] = None
        self.d.start()
        _KEEP[0] = self.d.proc.pid if self.d.proc else None
        return Client(self.d.socket, timeout=120)

    def c(self) -> Client:
        assert self.d is not None
        return Client(self.d.socket, timeout=120)

    # --- workload ---------------------------------------------------------------------------
    def write_turn(self, c: Client, sid: str) -> None:
        self.n += 1
        # In a sandbox with background processes, each turn also leaves one
        # running (a process made in the turn alive at its end: FS_PROC for
        # either inspector).
        bg = "setsid sleep 20 >/dev/null 2>&1 </dev/null & " if self.sandboxes.get(sid) else ""
        r = c.exec(sid, f"{bg}mkdir -p /data && echo {self.n}-{self.rng.random()} > /data/f{self.n} && {DIGEST}",
                   timeout=60)
        if r.get("exit_code", 0) == 0:
            self.digests[r["checkpoint"]] = (sid, r["stdout"].split()[0])

    def setup(self, c: Client) -> None:
        if self.sandboxes:
            return
        a = c.create_sandbox("busybox")["id"]
        b = c.create_sandbox("busybox")["id"]
        c.exec(b, "setsid sh -c 'while :; do sleep 0.2; done' >/dev/null 2>&1 </dev/null &", timeout=60)
        self.sandboxes = {a: False, b: True}
        for sid in (a, b):
            self.write_turn(c, sid)
        self.settle(c)

    def settle(self, c: Client, timeout: float = 60) -> None:
        """Wait until no checkpoint of ours is pending."""
        # No hang guard: a capture still pending after `timeout` shows up
        # in the committed-set comparison after the next kill.
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if all_settled([ck for sid in self.sandboxes for ck in c.checkpoints(sid)]):
                return
            time.sleep(0.2)

    def committed(self, c: Client) -> set[str]:
        return {ck["id"] for sid in self.sandboxes for ck in c.checkpoints(sid) if ck["state"] == "committed"}

    def action(self, c: Client, phase: str) -> None:
        """One attempt at reaching `phase` (runs in a thread; the kill cuts it)."""
        a, b = list(self.sandboxes)[:2]
        if phase == "fs_commit":
            self.write_turn(c, a)
        elif phase == "criu_dump":
            self.write_turn(c, b)
        elif phase == "compaction":
            for _ in range(6):
                self.write_turn(c, a)
        elif phase in ("rollback", "fork"):
            sid = self.rng.choice([a, b])
            cks = [k for k, (s, _) in self.digests.items() if s == sid]
            cks = [k for k in cks if k in self.committed(c)]
            if not cks:
                self.write_turn(c, sid)
                return
            cid = self.rng.choice(cks)
            if phase == "rollback":
                c.rollback(sid, cid)
            else:
                r = c.fork(cid)
                for s in r["sandboxes"]:
                    self.sandboxes[s] = self.sandboxes[sid]
        c.checkpoints(a)  # let the capture of the turn start

    # --- one run --------------------------------------------------------------------------------
    def run(self, phase: str) -> None:
        c = self.start(phase)
        self.say(f"  started ({phase})")
        self.setup(c)
        self.check(c)
        self.say("  checked")
        before = self.committed(c)
        offset = self.d.log.stat().st_size  # type: ignore[union-attr]
        hit = False
        for attempt in range(4):
            err: list[BaseException] = []

            def go() -> None:
                try:
                    self.action(self.c(), phase)
                except BaseException as e:  # the kill cuts the request
                    err.append(e)

            th = threading.Thread(target=go, daemon=True)
            th.start()
            end = time.monotonic() + 90
            while time.monotonic() < end:
                text = self.d.log.read_bytes()[offset:].decode(errors="replace")  # type: ignore[union-attr]
                if f"crabd-chaos: {phase}" in text:
                    hit = True
                    break
                if not th.is_alive():
                    # the capture runs after the reply: give it a moment
                    th.join()
                    if time.monotonic() + 3 < end:
                        end = min(end, time.monotonic() + 3)
                time.sleep(0.02)
            if hit:
                break
            th.join(60)
            before = self.committed(c)
        delay = self.rng.uniform(0, SLEEP + 0.4) if hit else 0.0
        if not hit:
            self.out["missed"] += 1
            self.say(f"  {self.driver} {phase}: phase not reached; killed anyway")
        time.sleep(delay)
        self.d.kill9()  # type: ignore[union-attr]
        self.out["kills"] += 1
        self.out["per_phase"][f"{self.driver}/{phase}"] = self.out["per_phase"].get(f"{self.driver}/{phase}", 0) + 1
        self.out["runs"] += 1
        self.before = before
        self.say(f"  {self.driver} {phase}: killed {delay * 1000:.0f} ms after the phase began")

    # --- checks ------------------------------------------------------------------------------------
    def check(self, c: Client, final: bool = False) -> None:
        reap_orphans(self.d.proc.pid if self.d and self.d.proc else None)
        listed = {s["id"]: s for s in c.sandboxes()}
        for sid in list(self.sandboxes):
            if sid not in listed:
                self.out["lost_sandboxes"] += 1
                self.say(f"  LOST sandbox {sid}")
                del self.sandboxes[sid]
        for sid in listed:
            if sid not in self.sandboxes:  # a fork the kill cut after it was stored
                self.sandboxes[sid] = False
        for sid in list(self.sandboxes):
            try:
                r = c.exec(sid, "true", timeout=30)
                ok = r.get("exit_code") == 0
            except CrabdError as e:
                ok = False
                self.say(f"  UNUSABLE {sid}: {e}")
            if not ok:
                self.out["unusable_sandboxes"] += 1
        for sid in list(self.sandboxes)[2:]:  # forks: usable (above), then gone (keeps runs cheap)
            if not any(s == sid for s, _ in self.digests.values()):
                try:
                    c.delete_sandbox(sid)
                    del self.sandboxes[sid]
                except CrabdError as e:
                    self.say(f"  destroying fork {sid}: {e}")
        committed = self.committed(c)
        for cid in getattr(self, "before", set()):
            if cid not in committed:
                self.out["lost_checkpoints"] += 1
                self.say(f"  LOST checkpoint {cid}")
        self.before = set()
        self.settle(c)
        committed = self.committed(c)
        # Verify: the newest recorded committed checkpoint per sandbox, or all at the end.
        todo: list[str] = []
        for sid in self.sandboxes:
            mine = sorted((k for k, (s, _) in self.digests.items() if s == sid and k in committed),
                          key=lambda k: int(k.rsplit("-", 1)[1]))
            todo += mine if final else mine[-1:]
        if final and self.verify_cap and len(todo) > self.verify_cap:
            todo = self.rng.sample(todo, self.verify_cap)
        for cid in todo:
            self.verify(c, cid)
        self.leaks(listed=set(self.sandboxes))

    def verify(self, c: Client, cid: str) -> None:
        sid, want = self.digests[cid]
        try:
            c.rollback(sid, cid)
            got = c.exec(sid, DIGEST, timeout=30)["stdout"].split()[0]
        except CrabdError as e:
            self.out["unrestorable_checkpoints"] += 1
            self.say(f"  UNRESTORABLE {cid}: {e}")
            return
        self.out["verified_checkpoints"] += 1
        if got != want:
            self.out["corrupt_accepted"] += 1
            self.say(f"  CORRUPT {cid}: digest {got} != recorded {want}")

    def _mounts(self) -> list[str]:
        real = str(self.state.resolve())
        out = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4].encode().decode("unicode_escape")
                if mp.startswith(real + "/"):
                    out.append(mp[len(real) + 1:])
        return out

    def leaks(self, listed: set[str], final: bool = False) -> None:
        sb_dir = self.state / "sandboxes"
        on_disk = {p.name for p in sb_dir.iterdir()} if sb_dir.is_dir() else set()
        runc = subprocess.run(["runc", "--root", str(self.state / "runc"), "list", "-q"],
                              capture_output=True, text=True).stdout.split()
        self.ever |= on_disk | set(runc) | listed
        n = len(on_disk - listed) + len(set(runc) - listed)
        if n:
            self.say(f"  LEAKED containers/sandbox dirs: {sorted((on_disk | set(runc)) - listed)}")
        self.out["leaked_containers"] += n
        # While the daemon runs a standby may be half-made (no standby.json
        # yet): standbys are judged at the end, after a restart that must
        # have dropped what earlier daemons left.
        bad = [d for sd in (self.state / "standbys").glob("*") for d in sd.glob("*")] if final else []
        if bad:
            self.say(f"  LEAKED standbys: {[str(d) for d in bad]}")
        self.out["leaked_standbys"] += len(bad)
        leaked_m = []
        for mp in self._mounts():
            parts = mp.split("/")
            if parts[0] == "sandboxes" and len(parts) > 1 and parts[1] in listed and not final:
                continue
            if parts[0] in ("standbys", "cr") and not final:
                continue  # standbys and CRIU restores in flight
            if parts[0] == "fs" and (len(parts) <= 2 or parts[1] in ("pool", "mnt")):
                continue  # the btrfs pool itself
            leaked_m.append(mp)
        if leaked_m:
            self.say(f"  LEAKED mounts: {leaked_m}")
        self.out["leaked_mounts"] += len(leaked_m)
        cg = []
        for ctrl in CGROUP.iterdir():
            base = ctrl / "crabd"
            if not base.is_dir():
                continue
            for d in base.iterdir():
                if not d.is_dir():
                    continue
                sid, _, token = d.name.partition(".")
                if sid not in self.ever:
                    continue  # another daemon's
                if final or (sid not in listed and not token):
                    cg.append(str(d))
        if cg:
            self.say(f"  LEAKED cgroups: {cg}")
        self.out["leaked_cgroups"] += len(cg)

    def finish(self) -> None:
        c = self.start(None)
        self.check(c, final=True)
        for sid in list(self.sandboxes):
            try:
                c.delete_sandbox(sid)
            except CrabdError as e:
                self.say(f"  destroy {sid}: {e}")
        self.d.stop()  # type: ignore[union-attr]
        # Standbys outlive a stop (caches, dropped at the next start): start
        # once more, stop, and then nothing of this state may be left.
        self.start(None)
        self.d.stop()  # type: ignore[union-attr]
        self.leaks(listed=set(), final=True)
        import deltafs
        fs = deltafs.open(str(self.state / "fs"), driver=self.driver)
        try:
            left = [i.name for i in fs.walk() if not i.name.startswith("img-")]
        finally:
            fs.close()
        if left:
            self.say(f"  LEAKED snapshots: {left}")
        self.out["leaked_snapshots"] += len(left)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 kills (default 50)")
    ap.add_argument("--runs", type=int, default=None, help="number of kills (overrides --quick)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--drivers", default="btrfs,overlay")
    ap.add_argument("--phases", default=None, help="only these phases (comma-separated)")
    ap.add_argument("--state-base", default="/var/tmp", help="where the state dirs are made (and deleted)")
    ap.add_argument("--verify-cap", type=int, default=0,
                    help="at the end roll back to a seeded sample of N recorded checkpoints per driver (0 = all)")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if os.geteuid() != 0:
        print("error: bench chaos needs root (runc, mounts, CRIU)", file=sys.stderr)
        return 2
    runs = a.runs or (10 if a.quick else 50)
    drivers = [d for d in a.drivers.split(",") if d]
    rng = random.Random(a.seed)
    out: dict[str, Any] = {k: 0 for k in ("runs", "kills", "lost_sandboxes", "lost_checkpoints", "corrupt_accepted",
                                          "unrestorable_checkpoints", "leaked_mounts", "leaked_cgroups",
                                          "leaked_standbys", "leaked_containers", "leaked_snapshots",
                                          "unusable_sandboxes", "missed", "verified_checkpoints")}
    out.update(per_phase={}, seed=a.seed, drivers=drivers, quick=a.quick)

    t0 = time.monotonic()
    stop_reaper = start_reaper()

    def say(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    for i, drv in enumerate(drivers):
        n = runs // len(drivers) + (1 if i < runs % len(drivers) else 0)
        phases = [p for p in PHASES[drv] if not a.phases or p in a.phases.split(",")]
        order = [phases[j % len(phases)] for j in range(n)]
        rng.shuffle(order)
        st = new_state(drv, a.state_base)
        ch = Chaos(drv, st, rng, out, say)
        ch.verify_cap = a.verify_cap
        say(f"{drv}: {n} kills in {st}")
        try:
            for ph in order:
                ch.run(ph)
            ch.finish()
        finally:
            if ch.d is not None and ch.d.proc is not None and ch.d.proc.poll() is None:
                ch.d.kill9()
            for sid in list(ch.ever):
                subprocess.run(["runc", "--root", str(st / "runc"), "delete", "--force", sid], capture_output=True)
            if not os.environ.get("CRABD_CHAOS_KEEP"):
                cleanup_state_dir(st)
    stop_reaper.set()
    out["duration_s"] = round(time.monotonic() - t0, 1)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:26} {v}")
    bad = sum(out[k] for k in out if k.startswith(("lost_", "leaked_", "corrupt", "unusable", "unrestorable")))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
