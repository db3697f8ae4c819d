#!/usr/bin/env python3
"""make demo: crabd's main job on this host, end to end.

Starts a crabd daemon, plays a short agent session (a code-repair task) in a
Debian sandbox through the daemon's API, crashes the sandbox in the middle
(every process killed, as by an OOM kill), lets crabd roll it back to its
last checkpoint on its own, and finishes the session. The same crash is then
replayed the way a chat-only framework recovers (a fresh sandbox from the
image, the transcript continues), and both end states are checked.

State: /var/lib/crabd-demo (the Debian image is debootstrapped there once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from crabd.client import Client
from crabd.errors import FailedPrecondition
from crabd.runtime import Runtime

STATE = Path(os.environ.get("CRABD_DEMO_STATE", "/var/lib/crabd-demo"))
SOCKET = STATE / "demo.sock"
IMAGE = "debian-py"
con = Console()

# The agent's session: (what the agent wants, shell command, expected exit code).
SESSION = [
    ("look around", "ls /", 0),
    ("write the project", "mkdir -p /work/calc && cd /work/calc && "
     "printf 'def mean(xs):\\n    return sum(xs) / len(xs) + 1\\n' > calc.py && "
     "printf 'from calc import mean\\nassert mean([1, 2, 3]) == 2, mean([1, 2, 3])\\nprint(\"ok\")\\n' > test_calc.py", 0),
    ("run the tests", "cd /work/calc && python3 test_calc.py", 1),
    ("read the code", "cat /work/calc/calc.py", 0),
    ("fix the bug", "cd /work/calc && sed -i 's/ + 1$//' calc.py && git init -q && git add . && "
     "git -c user.name=agent -c user.email=a@b commit -qm 'fix mean'", 0),
    # ---- the sandbox crashes here ----
    ("run the tests again", "cd /work/calc && python3 test_calc.py", 0),
    ("check history", "cd /work/calc && git log --oneline", 0),
]
CRASH_AFTER = 5
CHECK = "cd /work/calc && python3 test_calc.py && git log --oneline | grep -q 'fix mean'"


def start_daemon() -> subprocess.Popen[bytes]:
    log = open(STATE / "daemon.log", "ab")
    crabd = str(Path(sys.executable).parent / "crabd")
    proc = subprocess.Popen([crabd, "serve", "--state-dir", str(STATE), "--socket", str(SOCKET)],
                            stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"crabd serve exited; see {STATE / 'daemon.log'}")
        try:
            Client(SOCKET).health()
            return proc
        except FailedPrecondition:
            time.sleep(0.2)
    raise SystemExit("crabd serve did not answer within 90 s")


def crash(c: Client, sid: str) -> None:
    """Kill every process of the sandbox from the host, as the OOM killer would."""
    os.kill(c.sandbox(sid)["pid"], signal.SIGKILL)


def wait_recovered(c: Client, sid: str, since: int) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        if any(e["kind"] == "sandbox.rolled_back" for e in c.events(since=since, sandbox=sid)):
            return time.monotonic() - t0
        time.sleep(0.05)
    raise SystemExit("crabd did not recover the sandbox within 60 s")


def main() -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    con.rule("[bold]crabd demo: a crash in the middle of an agent session")
    rt = Runtime(STATE)
    if not rt.images.exists(IMAGE):
        t = time.monotonic()
        with con.status("building image debian-py with debootstrap (once per host, ~1 min) ...") as st:
            rt.images.build_debian(IMAGE, progress=lambda line: st.update(f"debootstrap: {line[:70]}"))
        con.print(f"built image {IMAGE} in {time.monotonic() - t:.0f} s")
    with con.status("starting crabd (loads the eBPF inspector) ..."):
        daemon = start_daemon()
    c = Client(SOCKET)
    h = c.health()
    con.print(f"crabd is up: file-system snapshots on [bold]{h['fs_driver']}[/bold], "
              f"turn inspector [bold]{h['inspector']}[/bold]")
    made: list[str] = []
    try:
        sid = c.create_sandbox(IMAGE, name=f"demo-{os.getpid()}")["id"]
        made.append(sid)
        con.print(f"sandbox [bold]{sid}[/bold] created\n")
        table = Table(box=None, header_style="bold")
        for col in ("turn", "agent", "exit", "plan", "checkpoint", "ms"):
            table.add_column(col)
        for i, (what, cmd, want) in enumerate(SESSION, 1):
            if i == CRASH_AFTER + 1:
                con.print(table)
                time.sleep(0.3)  # the agent waits on its LLM; crabd captures meanwhile
                since = max([e["seq"] for e in c.events(sandbox=sid)] or [0])
                con.print(f"\n[red bold]crash:[/red bold] every process in {sid} is killed (as by an OOM kill)")
                crash(c, sid)
                took = wait_recovered(c, sid, since)
                info = c.sandbox(sid)
                con.print(f"[green bold]crabd recovered it[/green bold] in {took * 1000:.0f} ms: rolled back to "
                          f"{info['head']} (turn {c.checkpoint(info['head'])['turn']}), branch {info['branch']}\n")
                table = Table(box=None, header_style="bold")
                for col in ("turn", "agent", "exit", "plan", "checkpoint", "ms"):
                    table.add_column(col)
            r = c.exec(sid, cmd, timeout=120)
            table.add_row(str(r["turn"]), what, str(r["exit_code"]), r["plan"], r["checkpoint"],
                          f"{r['duration'] * 1000:.0f}")
            if r["exit_code"] != want:
                raise SystemExit(f"turn {i} ({what}) exited {r['exit_code']}, expected {want}: {r['stderr']}")
        con.print(table)
        crabd_ok = c.exec(sid, CHECK)["exit_code"] == 0

        # The same crash, recovered the way a chat-only framework does it.
        chat = c.create_sandbox(IMAGE, name=f"demo-chat-{os.getpid()}")["id"]
        made.append(chat)
        for what, cmd, _ in SESSION[CRASH_AFTER:]:
            c.exec(chat, cmd, timeout=120)
        chat_ok = c.exec(chat, CHECK)["exit_code"] == 0

        cks = c.checkpoints(sid)
        skips = sum(1 for k in cks if k["plan"] == "SKIP")
        written = sum(k["bytes"] for k in cks)
        res = Table(title="after the crash", header_style="bold")
        for col in ("recovery", "files after the crash", "tests pass at the end"):
            res.add_column(col)
        res.add_row("crabd", "restored from the last checkpoint", "[green]yes[/green]" if crabd_ok else "[red]no[/red]")
        res.add_row("chat-only", "gone (fresh sandbox)", "[green]yes[/green]" if chat_ok else "[red]no[/red]")
        con.print(res)
        con.print(f"{len(cks)} checkpoints ({skips} SKIP turns shared their parent's state), "
                  f"{written / 1024:.0f} KiB written in all")
        return 0 if crabd_ok and not chat_ok else 1
    finally:
        for s in made:
            try:
                c.delete_sandbox(s)
            except Exception:
                pass
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        con.print("[dim]cleaned up: sandboxes deleted, daemon stopped[/dim]")


if __name__ == "__main__":
    sys.exit(main())
