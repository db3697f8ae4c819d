"""The daemon's own commands: `version`, `doctor` (can this host run
crabd), `serve` (run the daemon), `events` (its event log) and `ui` (a
local port forwarded to its operator view).
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from .. import __version__
from ._common import JsonOpt, SocketOpt, StateDir, client, err, guard, out, print_json, state


class CaptureChoice(str, Enum):
    """`crabd serve --capture` (the values of crabd.capture.MODES)."""
    auto = "auto"
    fs_only = "fs-only"
    full = "full"


def version() -> None:
    """Print crabd's version."""
    print(__version__)


def doctor(state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Check that this host can run crabd; each problem comes with its fix."""
    from ..doctor import run_checks
    checks = run_checks(state(state_dir))
    ok = not any(c.status == "fail" for c in checks)
    if as_json:
        print_json({"ok": ok, "checks": [c.to_dict() for c in checks]})
    else:
        from rich.table import Table
        t = Table(show_header=True, header_style="bold", box=None)
        for col in ("check", "status", "detail"):
            t.add_column(col, overflow="fold")
        colors = {"ok": "green", "warn": "yellow", "fail": "red"}
        for c in checks:
            t.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.detail + (f"\n[dim]fix: {c.fix}[/dim]" if c.fix else ""))
        out.print(t)
        out.print("[green]host ready[/green]" if ok else "[red]host not ready: fix the failed checks[/red]")
    raise typer.Exit(0 if ok else 1)


def serve(config_file: Optional[Path] = typer.Option(None, "--config", help="TOML settings",
                                                     show_default="/etc/crabd/config.toml if it exists"),
          state_dir: Optional[Path] = StateDir,
          socket: Optional[Path] = typer.Option(None, "--socket", envvar="CRABD_SOCKET", help="API unix socket",
                                                show_default="/run/crabd/crabd.sock"),
          no_auto_rollback: bool = typer.Option(False, "--no-auto-rollback", help="do not roll back sandboxes that die"),
          no_scheduler: bool = typer.Option(False, "--no-scheduler", help="start every checkpoint at once (benchmark baseline)"),
          capture: Optional[CaptureChoice] = typer.Option(None, "--capture", help="what each checkpoint saves",
                                                          show_default="auto, or the config file's"),
          tcp: Optional[str] = typer.Option(None, "--tcp", help="also serve HOST:PORT over TCP (needs --token-file)"),
          token_file: Optional[Path] = typer.Option(None, "--token-file", help="bearer token for the TCP listener"),
          oracle: Optional[Path] = typer.Option(None, "--oracle", envvar="CRABD_ORACLE",
                                                help="record each checkpoint's ground truth here (bench oracle)"),
          docker_socket: Optional[Path] = typer.Option(None, "--docker-socket",
                                                       help="Docker API unix socket [default: docker.sock next to --socket]"),
          no_docker: bool = typer.Option(False, "--no-docker", help="do not serve the Docker API")) -> None:
    """Run the crabd daemon (root): REST API on a unix socket."""
    import asyncio
    import logging
    from ..serve import serve as run
    from ..settings import load_settings
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s crabd %(levelname)s %(message)s")
    def build():  # type: ignore[no-untyped-def]
        path = config_file or Path("/etc/crabd/config.toml")
        s = load_settings(path, missing_ok=config_file is None).with_env()
        return s.with_overrides(state_dir=state_dir, socket=socket,
                                auto_rollback=False if no_auto_rollback else None,
                                tcp_listen=tcp, token_file=token_file.resolve() if token_file else None,
                                scheduler={"enabled": False} if no_scheduler else None,
                                capture=capture.value if capture else None,
                                docker_socket=docker_socket.resolve() if docker_socket else None,
                                docker_api=False if no_docker else None)
    settings = guard(build, False)
    if oracle is not None:  # read by crabd.serve into DaemonOptions.oracle_dir
        os.environ["CRABD_ORACLE"] = str(oracle.resolve())
    try:
        guard(lambda: asyncio.run(run(settings)), False)
    except KeyboardInterrupt:
        pass


def events(sandbox: Optional[str] = typer.Option(None, "--sandbox"), follow: bool = typer.Option(False, "--follow", "-f"),
           since: int = typer.Option(0, "--since", help="only events after this seq (page by page, all of them)"),
           latest: Optional[int] = typer.Option(None, "--latest", "-n", min=1, max=1000,
                                                help="only the newest N (with --follow: then the new ones)"),
           socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the daemon's events (rollbacks, deaths, checkpoints): all after
    --since, or the newest --latest N; --follow goes on with new ones."""
    c = client(socket)

    def show_event(e: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(e), flush=True)
        else:
            import datetime
            ts = datetime.datetime.fromtimestamp(e["ts"]).strftime("%H:%M:%S")
            out.print(f"{e['seq']:>6} {ts} {e['sandbox_id'] or '-':14} {e['kind']:22} "
                      f"{json.dumps(e['data'])[:60]}", highlight=False)

    # Pages through the cursor the daemon returns (a page holds at most 1,000).
    page = guard(lambda: c.events_page(since, sandbox, latest=latest), as_json)
    for e in page["events"]:
        show_event(e)
    while latest is None and page["more"]:
        page = guard(lambda: c.events_page(page["next"], sandbox), as_json)
        for e in page["events"]:
            show_event(e)
    if follow:
        try:
            for e in c.follow_events(page["next"], sandbox):
                show_event(e)
        except KeyboardInterrupt:
            return


def ui(port: int = typer.Option(0, "--port", help="local TCP port (0: a free one)"),
       host: str = typer.Option("127.0.0.1", "--host", help="address to listen on; keep it local"),
       token_file: Optional[Path] = typer.Option(None, "--token-file",
                                                 help="act as this owner (a token of crabd's tokens_file)"),
       socket: Optional[Path] = SocketOpt) -> None:
    """Open the operator view: a local port forwarded to the daemon's socket.
    Prints the URL to open (its #token= part is this session's key); runs
    until Ctrl-C. From another machine: ssh -L 8080:127.0.0.1:PORT HOST."""
    import asyncio
    from ..ui.forward import Forwarder

    c = client(socket)
    guard(c.health, False)  # a daemon answers there, or say how to start one
    bearer = guard(lambda: _read_token(token_file), False) if token_file else None

    async def run() -> None:
        f = Forwarder(str(c.socket), host=host, port=port, bearer=bearer)
        await f.start()
        out.print(f"crabd operator view: {f.url}", highlight=False, soft_wrap=True)
        err.print(f"forwarding {host}:{f.port} -> {c.socket}; Ctrl-C to stop", highlight=False)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


def _read_token(path: Path) -> str:
    from ..errors import FailedPrecondition
    try:
        return path.read_text().strip()
    except OSError as e:
        raise FailedPrecondition(f"cannot read {path}: {e}", fix="pass a file that holds one token") from e
