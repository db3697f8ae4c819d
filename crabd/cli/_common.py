"""What every command group of the `crabd` command line shares: the
consoles, the options that recur (`--state-dir`, `--socket`, `--json`,
registry access), the way an error is printed (message, fix, exit code),
the record and table printers, and the two things a command works on: the
image store of a state directory, or the daemon's client.

`client()` is the one place the CLI builds a crabd.client.Client; unit
tests replace that class to drive the commands without a daemon.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

from .. import config
from ..errors import CrabdError, InvalidArgument

if TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """A rich Console made at its first use: importing rich was a fifth of
    the CLI's start (measured), and `crabd serve`, `--json` and most
    successful commands never print through one."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._console: Console | None = None

    def __getattr__(self, name: str) -> Any:
        if self._console is None:
            from rich.console import Console
            self._console = Console(**self._kwargs)
        return getattr(self._console, name)


out: Console = _LazyConsole(width=int(os.environ.get("COLUMNS", "100")))  # type: ignore[assignment]
err: Console = _LazyConsole(stderr=True)  # type: ignore[assignment]

StateDir = typer.Option(None, "--state-dir", envvar="CRABD_STATE_DIR", help="crabd's state directory",
                        show_default=str(config.DEFAULT_STATE_DIR))
JsonOpt = typer.Option(False, "--json", help="print JSON instead of a table")
SocketOpt = typer.Option(None, "--socket", envvar="CRABD_SOCKET", help="daemon socket",
                         show_default="/run/crabd/crabd.sock")
RegistryAuthOpt = typer.Option(None, "--registry-auth", help="USER:PASSWORD for the registry (default: "
                               "the daemon's ~/.docker/config.json auths)")
InsecureOpt = typer.Option(False, "--insecure", help="plain HTTP to a registry that is not on localhost")


def state(state_dir: Optional[Path]) -> Path:
    return state_dir or config.DEFAULT_STATE_DIR


def fail(e: CrabdError, as_json: bool, code: int = 1) -> None:
    if as_json:
        print(json.dumps({"error": {"code": e.code, "message": e.message, "fix": e.fix}}))
    else:
        err.print(f"[red]error:[/red] {e.message}", highlight=False)
        if e.fix:
            err.print(f"[yellow]fix:[/yellow] {e.fix}", highlight=False)
    raise typer.Exit(code)


def guard(fn: Callable[[], Any], as_json: bool, exit_code: Callable[[CrabdError], int] = lambda e: 1) -> Any:
    try:
        return fn()
    except CrabdError as e:
        fail(e, as_json, exit_code(e))
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130)


def fail_usage(msg: str) -> None:
    raise InvalidArgument(msg)


def runtime(state_dir: Optional[Path]):  # type: ignore[no-untyped-def]
    from ..runtime import Runtime
    return Runtime(state(state_dir))


def client(socket: Optional[Path]):  # type: ignore[no-untyped-def]
    from .. import client as client_module  # looked up at each call: tests replace Client
    return client_module.Client(socket)


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def show(record: dict[str, Any], as_json: bool) -> None:
    """One record: JSON, or a `key: value` line per field."""
    if as_json:
        print_json(record)
        return
    for k, v in record.items():
        out.print(f"[bold]{k}[/bold]: {v}", highlight=False)


def table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    from rich.table import Table
    t = Table(box=None, header_style="bold")
    for c in cols:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["-" if r.get(c) is None else str(r.get(c)) for c in cols])
    out.print(t)
