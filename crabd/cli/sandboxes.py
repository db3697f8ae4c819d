"""`crabd sandbox ...` and `crabd exec`: creating, listing and removing
sandboxes, and running a command (one agent turn) in one, through the
daemon. `crabd exec` exits as `docker exec` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from ..errors import CommandNotExecutable, CommandNotFound, CrabdError
from ._common import (InsecureOpt, JsonOpt, RegistryAuthOpt, SocketOpt, client, err, fail_usage, guard, out,
                      print_json, show, table)

sandbox_app = typer.Typer(no_args_is_help=True, help="Sandboxes: runc containers agents run commands in.")


# `crabd exec`'s exit codes for its own failures, as `docker exec`'s
EXEC_CRABD_FAILED, EXEC_NOT_EXECUTABLE, EXEC_NOT_FOUND = 125, 126, 127


def exec_exit_code(e: CrabdError) -> int:
    if isinstance(e, CommandNotFound):
        return EXEC_NOT_FOUND
    if isinstance(e, CommandNotExecutable):
        return EXEC_NOT_EXECUTABLE
    return EXEC_CRABD_FAILED


@sandbox_app.command("create")
def sandbox_create(image: Optional[str] = typer.Argument(None, help="an image name (not with --from)"),
                   name: Optional[str] = typer.Option(None, "--name"),
                   memory_mb: int = typer.Option(2048, "--memory-mb", help="memory limit (0 = none)"),
                   pids: int = typer.Option(1024, "--pids", help="process limit (0 = none)"),
                   cpus: float = typer.Option(0.0, "--cpus", help="CPU limit in cores (0 = none)"),
                   from_ref: Optional[str] = typer.Option(None, "--from", help="a checkpoint pushed to an OCI "
                                                          "registry: HOST[:PORT]/REPO[:TAG][@DIGEST]"),
                   registry_auth: Optional[str] = RegistryAuthOpt, insecure: bool = InsecureOpt,
                   no_processes: bool = typer.Option(False, "--no-processes", help="with --from: files only, "
                                                     "a fresh init"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Create and start a sandbox from an image, or (--from) from a checkpoint in a registry."""
    if from_ref is not None:
        if image is not None:
            guard(lambda: fail_usage("give an image or --from, not both"), as_json)
        r = guard(lambda: client(socket).pull_sandbox(from_ref, name=name, registry_auth=registry_auth,
                                                        insecure=insecure, processes=not no_processes), as_json)
        print_json(r) if as_json else out.print(f"{r['sandbox']}  ({r['name']}, {r['status']}, restored "
                                                 f"{r['restored']} from {r['from']})")
        return
    if image is None:
        guard(lambda: fail_usage("give an image name, or --from REF"), as_json)
    lim = {"memory_bytes": memory_mb * 1024**2 or None, "pids": pids or None, "cpus": cpus or None}
    sb = guard(lambda: client(socket).create_sandbox(image, name=name, limits=lim), as_json)
    print_json(sb) if as_json else out.print(f"{sb['id']}  ({sb['name']}, {sb['status']})")


@sandbox_app.command("ls")
def sandbox_ls(socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List sandboxes."""
    sbs = guard(lambda: client(socket).sandboxes(), as_json)
    if as_json:
        print_json({"sandboxes": sbs})
    else:
        table(sbs, ["id", "name", "image", "status", "turn", "head", "branch"])


@sandbox_app.command("inspect")
def sandbox_inspect(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show one sandbox."""
    show(guard(lambda: client(socket).sandbox(sandbox), as_json), as_json)


@sandbox_app.command("migrate")
def sandbox_migrate(sandbox: str,
                    to: str = typer.Option(..., "--to", help="the registry reference to move it through "
                                           "(HOST[:PORT]/REPO[:TAG])"),
                    target_socket: Path = typer.Option(..., "--target-socket", help="the target daemon's API socket"),
                    registry_auth: Optional[str] = RegistryAuthOpt, insecure: bool = InsecureOpt,
                    socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Live-migrate a sandbox to another daemon: pre-copy, freeze, push the delta, restore there; the source
    goes only once the target runs it (on any failure it keeps running here)."""
    r = guard(lambda: client(socket).migrate_sandbox(sandbox, to, target_socket.absolute(),
                                                     registry_auth=registry_auth, insecure=insecure), as_json)
    print_json(r) if as_json else out.print(
        f"{r['sandbox']} -> {r['target_sandbox']} ({r['status']}, restored {r['restored']}) through "
        f"{r['reference']}; downtime {r['downtime_ms']:.0f} ms")


@sandbox_app.command("rm")
def sandbox_rm(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Destroy a sandbox and its checkpoints."""
    guard(lambda: client(socket).delete_sandbox(sandbox), as_json)
    print_json({"removed": sandbox}) if as_json else out.print(f"removed {sandbox}")


def exec_(sandbox: str, cmd: List[str] = typer.Argument(..., help="command and arguments (after --)"),
          timeout: float = typer.Option(600.0, "--timeout"), cwd: Optional[str] = typer.Option(None, "--cwd"),
          env: List[str] = typer.Option([], "--env", help="K=V, repeatable"),
          shell: bool = typer.Option(False, "--shell", help="run CMD as one /bin/sh -c string"),
          socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Run a command in a sandbox (one agent turn); exits with its exit code (125: crabd failed, 126: not
    executable, 127: not found, as `docker exec`)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        err.print("[red]error:[/red] no command given: crabd exec SANDBOX -- CMD \\[ARGS...]")
        raise typer.Exit(2)
    envd = {}
    for e in env:
        k, sep, v = e.partition("=")
        if not sep:
            err.print(f"[red]error:[/red] --env {e!r} is not K=V")
            raise typer.Exit(2)
        envd[k] = v
    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    command: Any = " ".join(cmd) if shell else list(cmd)
    try:
        res = guard(lambda: client(socket).exec(sandbox, command, env=envd or None, cwd=cwd, timeout=timeout,
                                                   stdin=stdin), as_json, exit_code=exec_exit_code)
    except typer.Exit:
        raise
    except Exception as e:  # crabd's own failure, whatever it is, is 125: never the command's code
        err.print(f"[red]error:[/red] {type(e).__name__}: {e}", highlight=False)
        raise typer.Exit(EXEC_CRABD_FAILED) from None
    if as_json:
        print_json(res)
    else:
        sys.stdout.write(res["stdout"])
        sys.stderr.write(res["stderr"])
        if os.environ.get("CRABD_VERBOSE"):
            err.print(f"[dim]turn {res['turn']}: {res['plan']} -> {res['checkpoint']}[/dim]")
    raise typer.Exit(res["exit_code"])
