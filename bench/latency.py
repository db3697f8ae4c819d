#!/usr/bin/env python3
"""Latency benchmark (issue 16 item 6): how fast a sandbox runs again, rolls
back, forks, runs a command, and how fast crabd serves after a restart.

    python -m bench.latency [--quick] [--json] [--rounds N] [--execs N] [--restarts N]
                            [--inspector bpf|proc] [--no-docker] [--storm N] [--out DIR]

One daemon (`crabd serve` on a fresh state dir under /var/tmp, busybox image),
two sandboxes: `fs` (files only: every turn's plan is FS) and `proc` (a
background `sleep` keeps a process alive: every turn's plan is FS_PROC). The
measurements are interleaved: every round does one of each, in this order,
so a slow phase of the host shows in all of them alike:

- exec_true_ms: `true` through crabd's Python client (one kept connection,
  as an agent keeps one) and `docker exec` of `true` in a busybox container
  of the local Docker engine (`docker run -d --network none`), alternating;
  `runtime` (extra): the same sandbox's exec path alone, crabd.runtime's
  `Runtime.exec` called by the bench (runc exec, or the init's channel),
  without the daemon's turn (inspector, checkpoint plan, store, HTTP);
- rollback_ms latest_*: a new turn, its checkpoint durable and its standby
  ready (the `standby.ready` event: CRIU's for `proc`, a stopped fresh init
  for `fs`), then the API rollback to it, client round trip; older_*: the rollback to the sandbox's first
  checkpoint of the bench (cold for `proc`: no standby holds it);
- fork_ms: `fork(checkpoint, 1)` and `fork(checkpoint, 8)` of the latest
  checkpoint, client round trip (the forks are deleted, untimed);
- kill_to_running_ms: a new turn made durable (its standby ready),
  then SIGKILL of every process of the sandbox (its cgroup's tasks): from
  the kill until an exec of `true` succeeds (the bench waits for the
  `sandbox.rolled_back` event, polling every 2 ms, then execs: what an
  agent following events sees); kill_to_rolled_back_ms: from the kill to
  that event's own timestamp (the daemon's clock, same host);
- storm_ms (issue 16 item 5): a syscall storm, `dd if=/dev/zero
  of=/dev/null bs=1 count=N` (N reads and N writes, 1e6 by default, --quick
  2e5), through crabd's client and through `docker exec`, alternating. The
  BPF inspector's tracepoints fire for every task of the host; only the
  watched sandbox's writes are counted (its cgroup), so crabd minus docker
  is what watching a sandbox costs, plus the exec paths' difference
  (exec_true_ms says how much that is);
- restart_ms (after some rounds): SIGTERM of crabd, then a new `crabd serve`:
  from its spawn to the first answered health request (`serving`, polled
  every 10 ms), to the first answered list of sandboxes right after it
  (`api`: the whole API, which a daemon may build after its first health
  answer), and to the last `sandbox.adopted` event (`adopted`);
  `serving_cpu`: the CPU time (user + system, all threads) the new daemon
  had used when it first answered, in ms: what the load multiplies.

Each figure is {"p50", "p99", "n"}, nearest rank (bench/_stats.py), ms.
The daemon inherits the environment: CRABD_EXEC_CHANNEL=0 measures `runc
exec` instead of the fast exec path through the sandbox's init (the default,
crabd/runtime/channel.py), CRABD_INIT a crabd-init of one's own; both are
recorded in "config".
`--quick`: 4 rounds of 5 execs each, 2 restarts (< 5 minutes here).
Needs root, runc, CRIU, and a Docker engine for the docker peer (started
here with `dockerd --iptables=false --bridge=none` when none answers, and
stopped again at the end; `--no-docker` leaves the peer out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench._stats import percentile
from crabd.errors import CrabdError
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, busybox_rootfs, cleanup_state_dir

IMAGE = "busybox"
TEST_STATE = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
DOCKER_IMAGE = "crabd-bench-busybox"
POLL_S = 0.002   # event polling while a recovery is awaited
WAIT_S = 120     # hang guard of every wait (a loaded host, not a latency bound)


def summary(xs: list[float]) -> dict[str, Any]:
    """{"p50", "p99", "n"} of samples in ms (nearest rank; None without samples)."""
    return {"p50": percentile(xs, 50, 3), "p99": percentile(xs, 99, 3), "n": len(xs)}


def _ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000


class DockerPeer:
    """A busybox container of the local Docker engine, for `docker exec`."""

    def __init__(self, rootfs: Path) -> None:
        self.started_engine: subprocess.Popen[bytes] | None = None
        if not self._answers():
            log = open("/var/log/crabd-dockerd.log", "ab")
            self.started_engine = subprocess.Popen(["dockerd", "--iptables=false", "--bridge=none"],
                                                   stdout=log, stderr=log, start_new_session=True)
            deadline = time.monotonic() + 60
            while not self._answers():
                if time.monotonic() > deadline or self.started_engine.poll() is not None:
                    raise RuntimeError("dockerd did not answer in 60 s (see /var/log/crabd-dockerd.log)")
                time.sleep(0.5)
        if self._docker("image", "inspect", DOCKER_IMAGE, check=False).returncode != 0:
            tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
            subprocess.run(["docker", "import", "-", DOCKER_IMAGE], stdin=tar.stdout, check=True,
                           capture_output=True, timeout=120)
            tar.wait(60)
        self.name = f"crabd-bench-latency-{secrets.token_hex(4)}"
        self._docker("run", "-d", "--network", "none", "--name", self.name, DOCKER_IMAGE, "sleep", "1000000")

    @staticmethod
    def _answers() -> bool:
        try:
            return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    @staticmethod
    def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        r = subprocess.run(["docker", *args], capture_output=True, timeout=120)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {r.stderr.decode(errors='replace').strip()}")
        return r

    def exec_true(self) -> float:
        t0 = time.monotonic()
        self._docker("exec", self.name, "true")
        return _ms(t0, time.monotonic())

    def close(self) -> None:
        self._docker("rm", "-f", self.name, check=False)
        if self.started_engine is not None:
            self.started_engine.send_signal(signal.SIGTERM)
            try:
                self.started_engine.wait(30)
            except subprocess.TimeoutExpired:
                self.started_engine.kill()


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.state = Path(tempfile.mkdtemp(prefix="crabd-bench-lat-", dir="/var/tmp"))
        self.rt = Runtime(self.state)
        self.samples: dict[str, list[float]] = {}
        self.notes: dict[str, int] = {"standby_promotions": 0, "cold_latest_proc": 0, "cold_latest_fs": 0,
                                      "restart_rounds": 0}
        env = {"CRABD_INSPECTOR": "proc"} if a.inspector == "proc" else None
        self.dh = DaemonHandle(self.state, env=env)
        self._client: Any = None
        self.docker: DockerPeer | None = None

    def add(self, key: str, ms: float) -> None:
        self.samples.setdefault(key, []).append(ms)

    # -- setup ------------------------------------------------------------------------------------
    def image_rootfs(self) -> Path:
        test = Runtime(TEST_STATE).images
        if test.exists(IMAGE):
            return Path(test.get(IMAGE).path)
        return busybox_rootfs(self.state / "busybox-rootfs")

    def setup(self) -> None:
        rootfs = self.image_rootfs()
        self.rt.images.import_path(str(rootfs), IMAGE)
        self.dh.start()
        if not self.a.no_docker:
            self.docker = DockerPeer(rootfs)
        c = self.client()
        self.fs = c.create_sandbox(IMAGE, name="lat-fs")["id"]
        self.proc = c.create_sandbox(IMAGE, name="lat-proc")["id"]
        r = c.exec(self.proc, "sleep 1000000 >/dev/null 2>&1 &")
        if r["plan"] != "FS_PROC":
            raise RuntimeError(f"a turn that leaves a process running got plan {r['plan']}, not FS_PROC: {r}")
        # the rollback targets "older": each sandbox's first checkpoint of the bench
        self.older = {self.fs: self.turn(self.fs, "echo 0 > /root/n")["checkpoint"],
                      self.proc: self.turn(self.proc, "echo 0 > /root/n")["checkpoint"]}
        self.wait_durable(self.fs)
        self.wait_durable(self.proc)

    def client(self) -> Any:
        if self._client is None:
            self._client = self.dh.client()
        return self._client

    def close(self) -> None:
        if self.docker is not None:
            self.docker.close()
        try:
            self.dh.shutdown()
        finally:
            if self._client is not None:
                self._client.close()
            cleanup_state_dir(self.state)

    # -- helpers ----------------------------------------------------------------------------------
    def turn(self, sid: str, cmd: str) -> dict[str, Any]:
        r = self.client().exec(sid, cmd)
        if r["exit_code"] != 0:
            raise RuntimeError(f"{cmd!r} in {sid} failed: {r}")
        return r

    def wait_durable(self, sid: str) -> None:
        c = self.client()
        deadline = time.monotonic() + WAIT_S
        while any(x["state"] == "pending" for x in c.checkpoints(sid, all=True)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"checkpoints of {sid} still pending after {WAIT_S} s")
            time.sleep(0.01)

    def wait_event(self, sid: str, since: int, want: Callable[[dict[str, Any]], bool],
                   interval: float = 0.01) -> dict[str, Any]:
        """The first event of `sid` after `since` that `want` accepts (a
        recovery failure raises)."""
        c = self.client()
        deadline = time.monotonic() + WAIT_S
        while True:
            for e in c.events(since=since, sandbox=sid):
                since = e["seq"]
                if e["kind"] == "sandbox.recovery_failed":
                    raise RuntimeError(f"crabd could not recover {sid}: {e['data']}")
                if want(e):
                    return e
            if time.monotonic() > deadline:
                raise RuntimeError(f"no awaited event of {sid} after {WAIT_S} s")
            time.sleep(interval)

    def fresh_target(self, sid: str, proc: bool, standby: bool = True) -> str:
        """A new turn, made durable (and its standby ready: a CRIU one for
        `proc`, a stopped fresh init for FS-only): the sandbox waits for its
        agent's LLM, as in a real run. Returns its checkpoint."""
        since = self.client().last_event_seq()
        ck = self.turn(sid, f"echo {secrets.token_hex(4)} > /root/n")["checkpoint"]
        self.wait_durable(sid)
        if standby:
            try:
                self.wait_event(sid, since, lambda e: e["kind"] == "standby.ready"
                                and e["data"].get("checkpoint") == ck)
            except RuntimeError:
                # measured anyway: then it is the cold path
                self.notes["cold_latest_proc" if proc else "cold_latest_fs"] += 1
        return ck

    # -- measurements -----------------------------------------------------------------------------
    def exec_round(self) -> None:
        c = self.client()
        for _ in range(self.a.execs):
            t0 = time.monotonic()
            r = c.exec(self.fs, ["true"])
            self.add("exec_true.crabd", _ms(t0, time.monotonic()))
            if r["exit_code"] != 0:
                raise RuntimeError(f"true failed through crabd: {r}")
            if self.docker is not None:
                self.add("exec_true.docker", self.docker.exec_true())
            self.wait_durable(self.fs)   # the daemon's capture of the turn above freezes the sandbox
            t0 = time.monotonic()
            self.rt.exec(self.fs, ["true"])
            self.add("exec_true.runtime", _ms(t0, time.monotonic()))

    def storm_round(self) -> None:
        cmd = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", f"count={self.a.storm}"]
        t0 = time.monotonic()
        r = self.client().exec(self.fs, cmd)
        self.add("storm.crabd", _ms(t0, time.monotonic()))
        if r["exit_code"] != 0:
            raise RuntimeError(f"the storm failed through crabd: {r}")
        self.wait_durable(self.fs)
        if self.docker is not None:
            t0 = time.monotonic()
            self.docker._docker("exec", self.docker.name, *cmd)
            self.add("storm.docker", _ms(t0, time.monotonic()))

    def rollback_round(self) -> None:
        c = self.client()
        for sid, kind in ((self.fs, "fs"), (self.proc, "proc")):
            ck = self.fresh_target(sid, kind == "proc")
            t0 = time.monotonic()
            r = c.rollback(sid, ck)
            self.add(f"rollback.latest_{kind}", _ms(t0, time.monotonic()))
            if "standby" in r.get("restored", ""):
                self.notes["standby_promotions"] += 1
            self.wait_durable(sid)
            t0 = time.monotonic()
            c.rollback(sid, self.older[sid])
            self.add(f"rollback.older_{kind}", _ms(t0, time.monotonic()))

    def fork_round(self) -> None:
        c = self.client()
        for sid, kind in ((self.fs, ""), (self.proc, "_proc")):
            ck = self.fresh_target(sid, False, standby=False)
            for n in (1, 8):
                t0 = time.monotonic()
                made = c.fork(ck, n)["sandboxes"]
                self.add(f"fork.{n}{kind}", _ms(t0, time.monotonic()))
                for s in made:
                    c.delete_sandbox(s)

    def kill_round(self) -> None:
        c = self.client()
        for sid, kind in ((self.fs, "fs"), (self.proc, "proc")):
            self.fresh_target(sid, kind == "proc")
            since = c.last_event_seq()
            pids = self.rt.pids(sid)
            t_kill, t0 = time.time(), time.monotonic()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ev = self.wait_event(sid, since, lambda e: e["kind"] == "sandbox.rolled_back", interval=POLL_S)
            deadline = time.monotonic() + WAIT_S
            while True:
                try:
                    if c.exec(sid, ["true"])["exit_code"] == 0:
                        break
                except CrabdError:
                    if time.monotonic() > deadline:
                        raise
            self.add(f"kill_to_running.{kind}", _ms(t0, time.monotonic()))
            self.add(f"kill_to_rolled_back.{kind}", (ev["ts"] - t_kill) * 1000)

    def restart_round(self) -> None:
        """SIGTERM crabd, start it again; spawn -> first health answer, and -> last adoption."""
        since = self.client().last_event_seq()
        n = len(self.client().sandboxes())
        self.client().close()
        self._client = None
        self.dh.stop()
        starter = threading.Thread(target=self.dh.start)   # DaemonHandle.start polls at 0.2 s: too coarse here
        t_wall, t0 = time.time(), time.monotonic()
        starter.start()
        probe = None
        deadline = t0 + WAIT_S
        while True:
            try:
                if probe is None and self.dh.socket.exists():
                    probe = self.dh.client()
                if probe is not None:
                    probe.health()
                    break
            except CrabdError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"crabd did not serve within {WAIT_S} s of its restart")
            time.sleep(0.01)
        self.add("restart.serving", _ms(t0, time.monotonic()))
        cpu = _cpu_ms(self.dh.proc.pid) if self.dh.proc is not None else None
        if cpu is not None:
            self.add("restart.serving_cpu", cpu)
        probe.sandboxes()   # the whole API (a health probe may be answered before it is built)
        self.add("restart.api", _ms(t0, time.monotonic()))
        starter.join(WAIT_S)
        probe.close()
        adopted: list[float] = []
        deadline = time.monotonic() + WAIT_S
        while len(adopted) < n:
            adopted = [e["ts"] for e in self.client().events(since=since) if e["kind"] == "sandbox.adopted"]
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(adopted)} of {n} sandboxes adopted after the restart")
            time.sleep(0.01)
        self.add("restart.adopted", (max(adopted) - t_wall) * 1000)
        self.notes["restart_rounds"] += 1

    def run(self) -> dict[str, Any]:
        restart_after = set(restart_rounds(self.a.rounds, self.a.restarts))
        t0 = time.monotonic()
        for i in range(self.a.rounds):
            self.exec_round()
            if self.a.storm:
                self.storm_round()
            self.rollback_round()
            self.fork_round()
            self.kill_round()
            if i in restart_after:
                self.restart_round()
        return self.result(time.monotonic() - t0)

    def result(self, wall_s: float) -> dict[str, Any]:
        s = self.samples

        def p(key: str) -> dict[str, Any]:
            return summary(s.get(key, []))
        return {
            "kill_to_running_ms": {"fs": p("kill_to_running.fs"), "proc": p("kill_to_running.proc")},
            "kill_to_rolled_back_ms": {"fs": p("kill_to_rolled_back.fs"), "proc": p("kill_to_rolled_back.proc")},
            "rollback_ms": {k: p(f"rollback.{k}") for k in ("latest_fs", "latest_proc", "older_fs", "older_proc")},
            "fork_ms": {k: p(f"fork.{k}") for k in ("1", "8", "1_proc", "8_proc")},
            "exec_true_ms": {"crabd": p("exec_true.crabd"), "docker": p("exec_true.docker"),
                             "runtime": p("exec_true.runtime")},
            "restart_ms": {"serving": p("restart.serving"), "adopted": p("restart.adopted"), "api": p("restart.api"),
                           "serving_cpu": p("restart.serving_cpu")},
            "storm_ms": {"crabd": p("storm.crabd"), "docker": p("storm.docker"), "syscalls": 2 * self.a.storm},
            "notes": self.notes,
            "config": {"quick": self.a.quick, "rounds": self.a.rounds, "execs": self.a.execs,
                       "restarts": self.a.restarts, "storm": self.a.storm, "inspector": self.inspector, "image": IMAGE,
                       "docker": self.docker is not None, "wall_s": round(wall_s, 1),
                       "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                       "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                       "crabd_init": os.environ.get("CRABD_INIT", "default"),
                       "exec_channel": os.environ.get("CRABD_EXEC_CHANNEL", "default (on)")},
        }

    @property
    def inspector(self) -> str:
        try:
            return str(self.client().health().get("inspector"))
        except CrabdError:
            return "unknown"


def _cpu_ms(pid: int) -> float | None:
    """CPU time (user + system, all threads) the process has used so far, ms."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def restart_rounds(rounds: int, restarts: int) -> list[int]:
    """The rounds after which crabd restarts: `restarts` of them, spread evenly, the last one included."""
    if restarts <= 0 or rounds <= 0:
        return []
    restarts = min(restarts, rounds)
    return sorted({rounds - 1 - (i * rounds) // restarts for i in range(restarts)})


def text(res: dict[str, Any]) -> str:
    lines = [f"{'figure':34} {'p50 ms':>10} {'p99 ms':>10} {'n':>4}"]
    for group, vals in res.items():
        if group in ("notes", "config"):
            continue
        for k, v in vals.items():
            if not isinstance(v, dict):
                continue
            p50 = "-" if v["p50"] is None else f"{v['p50']:.1f}"
            p99 = "-" if v["p99"] is None else f"{v['p99']:.1f}"
            lines.append(f"{group + '.' + k:34} {p50:>10} {p99:>10} {v['n']:>4}")
    lines.append(f"notes: {res['notes']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 rounds, 5 execs a round, 2 restarts")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 12, --quick 4)")
    ap.add_argument("--execs", type=int, help="exec round trips per round and peer (default 10, --quick 5)")
    ap.add_argument("--restarts", type=int, help="daemon restarts (default 4, --quick 2)")
    ap.add_argument("--inspector", choices=("bpf", "proc"), default="bpf",
                    help="crabd's inspector (bpf: the default, compiled at each start)")
    ap.add_argument("--no-docker", action="store_true", help="leave out the docker exec peer")
    ap.add_argument("--storm", type=int, help="bytes the syscall storm copies one at a time "
                                             "(default 1e6, --quick 2e5; 0: no storm)")
    ap.add_argument("--out", type=Path, help="also write results.json there")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    a.rounds = a.rounds if a.rounds is not None else (4 if a.quick else 12)
    a.execs = a.execs if a.execs is not None else (5 if a.quick else 10)
    a.restarts = a.restarts if a.restarts is not None else (2 if a.quick else 4)
    a.storm = a.storm if a.storm is not None else (200_000 if a.quick else 1_000_000)
    b = Bench(a)
    try:
        b.setup()
        res = b.run()
    finally:
        b.close()
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1) if a.json else text(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
