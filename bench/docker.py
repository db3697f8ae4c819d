"""Docker CLI/SDK against dockerd and against crabd's Docker API, side by side (issue 17, item 6).

    python -m bench.docker [--quick] [--json] [--proc-inspector]    (or: crabd bench docker ...)

Same host, one run, interleaved (each round does every path once, in a
rotating order, so load drifts hit all paths alike). Operations:
- exec_true_ms: an exec of `true` (round trip: create + start + output + exit code)
- exec_1mib_ms: an exec that prints 1 MiB
- create_start_ms: a container (sandbox) made and started, running `sleep 1000`
- remove_ms: that container removed (force)
Paths: docker_cli_dockerd, docker_cli_crabd (the docker CLI), sdk_dockerd,
sdk_crabd (the docker Python SDK), crabd_client (crabd's own client).

dockerd is a private one started here (`dockerd --iptables=false
--bridge=none`, own data root, exec root and socket under /var/tmp), with
the busybox test image imported; containers run with `--network none`.
crabd is a `crabd serve` on its own state dir (BPF inspector unless
--proc-inspector), so every crabd exec is a turn with a plan and a
checkpoint, where dockerd's is not. crash_mid_session: the container's
processes killed between two steps of a session, on each engine (see
_crash). Prints JSON: each op -> path ->
{p50, p99, n} (ms, nearest-rank percentiles from bench/_stats.py), and
ratio_p50 = docker_cli_crabd / docker_cli_dockerd per op.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# Run as `python -m bench.docker` or `crabd bench docker` (never as a script
# path: bench/ first on sys.path would make this file shadow the docker SDK).
from bench._stats import percentile
from crabd.runtime import Runtime
from crabd.testing import DaemonHandle, cleanup_state_dir, wait_until

TEST_IMAGES = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
IMAGE = "busybox"
ONE_MIB = "head -c 1048576 /dev/zero | tr '\\0' x"
PATHS = ["docker_cli_dockerd", "docker_cli_crabd", "sdk_dockerd", "sdk_crabd", "crabd_client"]


def _run(argv: list[str], timeout: float = 300, input: bytes | None = None) -> bytes:
    r = subprocess.run(argv, capture_output=True, timeout=timeout, input=input)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} -> {r.returncode}: {r.stderr.decode()[-500:]}")
    return r.stdout


class Dockerd:
    """A private dockerd: its own data root, exec root and socket."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if shutil.which("dockerd") is None:
            raise SystemExit("dockerd is missing: run scripts/setup-host (docker.io)")
        log = open(self.root / "dockerd.log", "ab")
        self.proc = subprocess.Popen(
            ["dockerd", "--iptables=false", "--bridge=none", "--data-root", str(self.root / "data"),
             "--exec-root", str(self.root / "exec"), "--pidfile", str(self.root / "dockerd.pid"),
             "-H", f"unix://{self.sock}"], stdout=log, stderr=log, start_new_session=True)
        wait_until(lambda: self.sock.exists() and subprocess.run(self.cli("version"), capture_output=True,
                                                                 timeout=30).returncode == 0,
                   "dockerd answering", timeout=120, interval=0.5)
        rootfs = Runtime(TEST_IMAGES).images.get(IMAGE).path
        tar = subprocess.run(["tar", "-C", rootfs, "-c", "."], capture_output=True, timeout=120, check=True).stdout
        _run(self.cli("import", "-", IMAGE), input=tar)

    def cli(self, *args: str) -> list[str]:
        return ["docker", "-H", f"unix://{self.sock}", *args]

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            for cid in _run(self.cli("ps", "-aq")).split():
                subprocess.run(self.cli("rm", "-f", cid.decode()), capture_output=True, timeout=60)
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        subprocess.run(["umount", "-R", "-l", str(self.root / "data")], capture_output=True)
        subprocess.run(["umount", "-R", "-l", str(self.root / "exec")], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def _check_1mib(out: bytes | str) -> None:
    n = len(out.encode() if isinstance(out, str) else out)
    if n != 1 << 20:
        raise RuntimeError(f"the 1 MiB exec returned {n} bytes")


def _crash(cli: Callable[..., list[str]], client: Any = None) -> dict[str, Any]:
    """The same two-step session on each engine, with the container's
    processes killed (kill -9 of its init / PID 1) between the steps, as
    an OOM kill would: does the next `docker exec` find the first step's
    work? dockerd: the container has exited, the exec fails. crabd: it
    rolls the sandbox back to its last checkpoint and the exec goes on."""
    name = "crash-session"
    _run(cli("run", "-d", "--network", "none", "--name", name, IMAGE, "sleep", "1000"))
    try:
        _run(cli("exec", name, "sh", "-c", "echo step1 > /work.txt"))
        if client is not None:  # the step's checkpoint is captured while the agent waits on its LLM
            wait_until(lambda: all(k["state"] == "committed" for k in client.checkpoints(name, all=True)),
                       "checkpoints committed")
        pid = int(_run(cli("inspect", "--format", "{{.State.Pid}}", name)).strip())
        os.kill(pid, 9)
        t0 = time.monotonic()
        deadline = t0 + 60
        r = subprocess.run(cli("exec", name, "cat", "/work.txt"), capture_output=True, timeout=120)
        while client is not None and r.returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.2)  # crabd's recovery is under way
            r = subprocess.run(cli("exec", name, "cat", "/work.txt"), capture_output=True, timeout=120)
        return {"exec_after_kill_rc": r.returncode, "work_kept": r.stdout == b"step1\n",
                "error": r.stderr.decode()[-200:].strip(), "s_until_exec_ok": round(time.monotonic() - t0, 3)
                if r.returncode == 0 else None}
    finally:
        subprocess.run(cli("rm", "-f", name), capture_output=True, timeout=120)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    ap.add_argument("--proc-inspector", action="store_true", help="crabd with the /proc inspector (no BPF)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    rounds, lifecycle = (5, 2) if a.quick else (30, 6)
    load_before = os.getloadavg()  # the host is shared: each result says its load

    import docker as docker_sdk

    work = Path(tempfile.mkdtemp(prefix="crabd-bench-docker-", dir="/var/tmp"))
    dd = Dockerd(work / "dockerd")
    dd.root.mkdir()
    state = work / "crabd"
    state.mkdir()
    Runtime(state).images.import_path(Runtime(TEST_IMAGES).images.get(IMAGE).path, IMAGE)
    crabd = DaemonHandle(state, env={"CRABD_INSPECTOR": "proc"} if a.proc_inspector else None)
    samples: dict[str, dict[str, list[float]]] = {op: {p: [] for p in PATHS}
                                                  for op in ("exec_true_ms", "exec_1mib_ms", "create_start_ms", "remove_ms")}
    plans: dict[str, int] = {}
    try:
        dd.start()
        crabd.start()
        csock = state / "docker.sock"
        cli = {"docker_cli_dockerd": dd.cli, "docker_cli_crabd": lambda *x: ["docker", "-H", f"unix://{csock}", *x]}
        sdk = {"sdk_dockerd": docker_sdk.DockerClient(base_url=f"unix://{dd.sock}", version="auto", timeout=300),
               "sdk_crabd": docker_sdk.DockerClient(base_url=f"unix://{csock}", version="auto", timeout=300)}
        client = crabd.client()

        def make(path: str, name: str) -> Callable[[], Any]:
            if path in cli:
                return lambda: _run(cli[path]("run", "-d", "--network", "none", "--name", name, IMAGE, "sleep", "1000"))
            if path in sdk:
                return lambda: sdk[path].containers.run(IMAGE, ["sleep", "1000"], detach=True, name=name,
                                                        network_mode="none")
            return lambda: client.create_sandbox(IMAGE, name=name)

        def remove(path: str, name: str) -> Callable[[], Any]:
            if path in cli:
                return lambda: _run(cli[path]("rm", "-f", name))
            if path in sdk:
                return lambda: sdk[path].containers.get(name).remove(force=True)
            return lambda: client.delete_sandbox(name)

        def execute(path: str, name: str, cmd: str, check: Callable[[Any], None] | None) -> Callable[[], Any]:
            if path in cli:
                return lambda: (check or (lambda _: None))(_run(cli[path]("exec", name, "sh", "-c", cmd)))
            if path in sdk:
                ct = sdk[path].containers.get(name)
                return lambda: (check or (lambda _: None))(ct.exec_run(["sh", "-c", cmd]).output)

            def own() -> None:
                r = client.exec(name, cmd)
                plans[r["plan"]] = plans.get(r["plan"], 0) + 1
                (check or (lambda _: None))(r["stdout"])
            return own

        def rotate(i: int) -> list[str]:
            return PATHS[i % len(PATHS):] + PATHS[:i % len(PATHS)]

        for i in range(lifecycle):
            for p in rotate(i):
                samples["create_start_ms"][p].append(_timed(make(p, f"lc-{p.replace('_', '-')}-{i}")))
            for p in rotate(i + 1):
                samples["remove_ms"][p].append(_timed(remove(p, f"lc-{p.replace('_', '-')}-{i}")))
        for p in PATHS:
            make(p, f"ex-{p.replace('_', '-')}")()
        for i in range(rounds):
            for p in rotate(i):
                name = f"ex-{p.replace('_', '-')}"
                samples["exec_true_ms"][p].append(_timed(execute(p, name, "true", None)))
                samples["exec_1mib_ms"][p].append(_timed(execute(p, name, ONE_MIB, _check_1mib)))
        for p in PATHS:
            remove(p, f"ex-{p.replace('_', '-')}")()
        crash = {"dockerd": _crash(dd.cli), "crabd": _crash(cli["docker_cli_crabd"], client)}
    finally:
        crabd.shutdown()
        cleanup_state_dir(state)
        dd.stop()
        shutil.rmtree(work, ignore_errors=True)

    out: dict[str, Any] = {}
    for op, by in samples.items():
        out[op] = {p: {"p50": percentile(xs, 50, 2), "p99": percentile(xs, 99, 2), "n": len(xs)} for p, xs in by.items()}
    out["ratio_p50"] = {op: round(out[op]["docker_cli_crabd"]["p50"] / out[op]["docker_cli_dockerd"]["p50"], 3)
                        for op in samples}
    out["crash_mid_session"] = crash
    out["crabd_plans"] = plans  # the crabd_client execs' plans: each was a checkpointed turn
    out["setup"] = {"rounds": rounds, "lifecycle_rounds": lifecycle,
                    "inspector": "proc" if a.proc_inspector else "bpf", "cpus": os.cpu_count(),
                    "command": "python -m bench.docker" + (" --quick" if a.quick else "") +
                               (" --proc-inspector" if a.proc_inspector else ""),
                    "load_avg": {"before": [round(x, 2) for x in load_before],
                                 "after": [round(x, 2) for x in os.getloadavg()]}}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    for op in samples:
        print(op)
        for p in PATHS:
            v = out[op][p]
            print(f"  {p:20s} p50 {v['p50']:9.2f} ms  p99 {v['p99']:9.2f} ms  n={v['n']}")
        print(f"  ratio p50 (docker CLI: crabd / dockerd) {out['ratio_p50'][op]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
