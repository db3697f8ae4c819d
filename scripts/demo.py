#!/usr/bin/env python3
"""make demo: crabd's main job on this host, end to end.

Builds (once) a Python-capable Debian image, creates a sandbox, plays a short
agent session in it (write code, run it, start a background server, use it),
and cleans up. Each step prints what it did and how long it took.
"""

from __future__ import annotations

import os
import sys
import time

from rich.console import Console
from rich.table import Table

from crabd.runtime import Runtime

IMAGE = os.environ.get("CRABD_DEMO_IMAGE", "debian-py")
con = Console()


def main() -> int:
    state = os.environ.get("CRABD_STATE_DIR", "/var/lib/crabd")
    rt = Runtime(state)
    con.rule("[bold]crabd demo")
    if not rt.images.exists(IMAGE):
        t = time.monotonic()
        with con.status("building image debian-py with debootstrap (once per host, ~1 min) ...") as st:
            rt.images.build_debian(IMAGE, progress=lambda line: st.update(f"debootstrap: {line[:70]}"))
        con.print(f"built image {IMAGE} in {time.monotonic() - t:.0f} s")
    img = rt.images.get(IMAGE)
    con.print(f"image [bold]{img.name}[/bold]: {img.size_bytes / 1e6:.0f} MB, {img.files} entries")

    t = time.monotonic()
    sb = rt.create(IMAGE, name=f"demo-{os.getpid()}")
    con.print(f"sandbox [bold]{sb.id}[/bold] running (runc, crabd-init as PID 1) in {1000 * (time.monotonic() - t):.0f} ms")

    turns = [
        ("check the toolchain", "python3 --version && git --version"),
        ("write code", "mkdir -p /work && printf 'def add(a, b):\\n    return a + b\\n' > /work/calc.py && ls -l /work"),
        ("run it", "cd /work && python3 -c 'import calc; print(calc.add(2, 3))'"),
        ("commit it", "cd /work && git init -q && git add . && git -c user.name=a -c user.email=a@b commit -qm calc && git log --oneline"),
        ("start a server", "cd /work && (python3 -m http.server 8000 >/tmp/http.log 2>&1 &) && sleep 0.5 && echo started"),
        ("use the server", "curl -s http://127.0.0.1:8000/calc.py | head -2"),
    ]
    table = Table(box=None, header_style="bold")
    for col in ("turn", "what", "exit", "ms", "output"):
        table.add_column(col, overflow="fold")
    try:
        for i, (what, cmd) in enumerate(turns, 1):
            r = rt.exec(sb.id, cmd, timeout=60)
            table.add_row(str(i), what, str(r.exit_code), f"{1000 * r.duration:.0f}",
                          (r.stdout + r.stderr).strip().replace("\n", " | ")[:60])
            if r.exit_code != 0:
                raise SystemExit(f"turn {i} failed: {r.stderr}")
        con.print(table)
        con.print(f"processes in the sandbox now: {len(rt.pids(sb.id))} (the server outlived its turn)")
    finally:
        rt.destroy(sb.id)
        con.print(f"sandbox {sb.id} destroyed: no mounts, cgroups or files left")
    con.print("[dim]checkpoint, crash and recovery join this demo as the deltafs/deltacr/daemon issues land.[/dim]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
