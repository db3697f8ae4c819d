"""The `crabd` command line.

Every command that reports has `--json`; every command that touches state
takes `--state-dir` (or $CRABD_STATE_DIR). Errors print what went wrong and
how to fix it, on stderr, and exit 1 (2 for bad usage). `crabd exec` exits
as `docker exec` does: the command's own code, 125 when crabd itself failed,
126 when the command cannot be executed, 127 when it is not found.

Defaults are shown by typer (`show_default=`), never written as
"[default: ...]" in a help string: Rich reads brackets as markup and drops them.

Image commands work on the state directory; sandbox, exec, checkpoint,
rollback, fork and event commands go through the daemon's socket
(`--socket`, or $CRABD_SOCKET, default /run/crabd/crabd.sock).

Size (~600 lines): one typer app, one short function per command (each a
call to the client or the image store, and its table): the app's command
table reads in one place, and docs/reference/cli.md is rendered from it.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__, config
from .cli_bench import BenchGroup
from .errors import CommandNotExecutable, CommandNotFound, CrabdError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="crabd: recoverable sandboxes for AI agents (checkpoint, roll back, fork).")
image_app = typer.Typer(no_args_is_help=True, help="Images: root file systems sandboxes start from.")
sandbox_app = typer.Typer(no_args_is_help=True, help="Sandboxes: runc containers agents run commands in.")
bench_app = typer.Typer(cls=BenchGroup, no_args_is_help=True,
                        help="Benchmarks of a source checkout (bench/; `crabd bench NAME --help`).")
app.add_typer(image_app, name="image")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(bench_app, name="bench")

out = Console(width=int(os.environ.get("COLUMNS", "100")))
err = Console(stderr=True)

StateDir = typer.Option(None, "--state-dir", envvar="CRABD_STATE_DIR", help="crabd's state directory",
                        show_default=str(config.DEFAULT_STATE_DIR))
JsonOpt = typer.Option(False, "--json", help="print JSON instead of a table")
RegistryAuthOpt = typer.Option(None, "--registry-auth", help="USER:PASSWORD for the registry (default: "
                               "the daemon's ~/.docker/config.json auths)")
InsecureOpt = typer.Option(False, "--insecure", help="plain HTTP to a registry that is not on localhost")


def _state(state_dir: Optional[Path]) -> Path:
    return state_dir or config.DEFAULT_STATE_DIR


# `crabd exec`'s exit codes for its own failures, as `docker exec`'s
EXEC_CRABD_FAILED, EXEC_NOT_EXECUTABLE, EXEC_NOT_FOUND = 125, 126, 127


def exec_exit_code(e: CrabdError) -> int:
    if isinstance(e, CommandNotFound):
        return EXEC_NOT_FOUND
    if isinstance(e, CommandNotExecutable):
        return EXEC_NOT_EXECUTABLE
    return EXEC_CRABD_FAILED


class CaptureChoice(str, Enum):
    """`crabd serve --capture` (the values of crabd.capture.MODES)."""
    auto = "auto"
    fs_only = "fs-only"
    full = "full"


def _fail(e: CrabdError, as_json: bool, code: int = 1) -> None:
    if as_json:
        print(json.dumps({"error": {"code": e.code, "message": e.message, "fix": e.fix}}))
    else:
        err.print(f"[red]error:[/red] {e.message}", highlight=False)
        if e.fix:
            err.print(f"[yellow]fix:[/yellow] {e.fix}", highlight=False)
    raise typer.Exit(code)


def _guard(fn: Callable[[], Any], as_json: bool, exit_code: Callable[[CrabdError], int] = lambda e: 1) -> Any:
    try:
        return fn()
    except CrabdError as e:
        _fail(e, as_json, exit_code(e))
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130)


def _runtime(state_dir: Optional[Path]):  # type: ignore[no-untyped-def]
    from .runtime import Runtime
    return Runtime(_state(state_dir))


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


# --- top level ------------------------------------------------------------------
@app.command()
def version() -> None:
    """Print crabd's version."""
    print(__version__)


@app.command()
def doctor(state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Check that this host can run crabd; each problem comes with its fix."""
    from .doctor import run_checks
    checks = run_checks(_state(state_dir))
    ok = not any(c.status == "fail" for c in checks)
    if as_json:
        _print_json({"ok": ok, "checks": [c.to_dict() for c in checks]})
    else:
        t = Table(show_header=True, header_style="bold", box=None)
        for col in ("check", "status", "detail"):
            t.add_column(col, overflow="fold")
        colors = {"ok": "green", "warn": "yellow", "fail": "red"}
        for c in checks:
            t.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.detail + (f"\n[dim]fix: {c.fix}[/dim]" if c.fix else ""))
        out.print(t)
        out.print("[green]host ready[/green]" if ok else "[red]host not ready: fix the failed checks[/red]")
    raise typer.Exit(0 if ok else 1)


@app.command()
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
    from .serve import serve as run
    from .settings import load_settings
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
    settings = _guard(build, False)
    if oracle is not None:  # read by crabd.serve into DaemonOptions.oracle_dir
        os.environ["CRABD_ORACLE"] = str(oracle.resolve())
    try:
        _guard(lambda: asyncio.run(run(settings)), False)
    except KeyboardInterrupt:
        pass


# --- images -----------------------------------------------------------------------
@image_app.command("import")
def image_import(source: str = typer.Argument(..., help="directory, tarball, or docker://NAME[:TAG]"),
                 name: str = typer.Option(..., "--name", help="image name"),
                 state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Import a root file system as an image."""
    rt = _runtime(state_dir)
    with err.status(f"importing {source} as {name} ..."):
        img = _guard(lambda: rt.images.import_path(source, name), as_json)
    _image_out(img, as_json)


@image_app.command("build")
def image_build(distro: str = typer.Argument(..., help="only 'debian' for now"),
                name: str = typer.Option(..., "--name"),
                packages: str = typer.Option("python3,python3-venv,python3-pip,git,curl,ca-certificates", "--packages",
                                             help="comma-separated Debian packages added to minbase"),
                suite: str = typer.Option("bookworm", "--suite"),
                mirror: str = typer.Option("http://deb.debian.org/debian", "--mirror"),
                state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Build an image with debootstrap (~45 s and ~420 MB for the default packages)."""
    if distro != "debian":
        err.print(f"[red]error:[/red] unknown distro {distro!r}; only 'debian' is supported")
        raise typer.Exit(2)
    rt = _runtime(state_dir)
    with err.status("debootstrap ...") as st:
        img = _guard(lambda: rt.images.build_debian(name, suite=suite, mirror=mirror,
                                                    packages=[p.strip() for p in packages.split(",") if p.strip()],
                                                    progress=lambda line: st.update(f"debootstrap: {line[:70]}")),
                     as_json)
    _image_out(img, as_json)


def _image_out(img: Any, as_json: bool) -> None:
    if as_json:
        _print_json(img.to_dict())
    else:
        out.print(f"image [bold]{img.name}[/bold]: {img.files} entries, {img.size_bytes / 1e6:.1f} MB ({img.source})")


@image_app.command("ls")
def image_ls(state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """List images."""
    rt = _runtime(state_dir)
    imgs = _guard(rt.images.list, as_json)
    if as_json:
        _print_json({"images": [i.to_dict() for i in imgs]})
        return
    t = Table(box=None, header_style="bold")
    for col in ("name", "size", "entries", "source"):
        t.add_column(col, overflow="fold")
    for i in imgs:
        t.add_row(i.name, f"{i.size_bytes / 1e6:.0f} MB", str(i.files), i.source)
    out.print(t)


@image_app.command("rm")
def image_rm(name: str, state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Remove an image (refused while a sandbox uses it)."""
    rt = _runtime(state_dir)
    _guard(lambda: rt.images.remove(name), as_json)
    if as_json:
        _print_json({"removed": name})
    else:
        out.print(f"removed image {name}")


# --- sandboxes (through the daemon) -----------------------------------------------------
SocketOpt = typer.Option(None, "--socket", envvar="CRABD_SOCKET", help="daemon socket",
                         show_default="/run/crabd/crabd.sock")
checkpoint_app = typer.Typer(no_args_is_help=True, help="Checkpoints: list, inspect, create, delete, diff.")
app.add_typer(checkpoint_app, name="checkpoint")


def _client(socket: Optional[Path]):  # type: ignore[no-untyped-def]
    from .client import Client
    return Client(socket)


def _show(record: dict[str, Any], as_json: bool) -> None:
    """One record: JSON, or a `key: value` line per field."""
    if as_json:
        _print_json(record)
        return
    for k, v in record.items():
        out.print(f"[bold]{k}[/bold]: {v}", highlight=False)


def _table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    t = Table(box=None, header_style="bold")
    for c in cols:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*["-" if r.get(c) is None else str(r.get(c)) for c in cols])
    out.print(t)


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
            _guard(lambda: _fail_usage("give an image or --from, not both"), as_json)
        r = _guard(lambda: _client(socket).pull_sandbox(from_ref, name=name, registry_auth=registry_auth,
                                                        insecure=insecure, processes=not no_processes), as_json)
        _print_json(r) if as_json else out.print(f"{r['sandbox']}  ({r['name']}, {r['status']}, restored "
                                                 f"{r['restored']} from {r['from']})")
        return
    if image is None:
        _guard(lambda: _fail_usage("give an image name, or --from REF"), as_json)
    lim = {"memory_bytes": memory_mb * 1024**2 or None, "pids": pids or None, "cpus": cpus or None}
    sb = _guard(lambda: _client(socket).create_sandbox(image, name=name, limits=lim), as_json)
    _print_json(sb) if as_json else out.print(f"{sb['id']}  ({sb['name']}, {sb['status']})")


def _fail_usage(msg: str) -> None:
    from .errors import InvalidArgument
    raise InvalidArgument(msg)


@sandbox_app.command("ls")
def sandbox_ls(socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List sandboxes."""
    sbs = _guard(lambda: _client(socket).sandboxes(), as_json)
    if as_json:
        _print_json({"sandboxes": sbs})
    else:
        _table(sbs, ["id", "name", "image", "status", "turn", "head", "branch"])


@sandbox_app.command("inspect")
def sandbox_inspect(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show one sandbox."""
    _show(_guard(lambda: _client(socket).sandbox(sandbox), as_json), as_json)


@sandbox_app.command("rm")
def sandbox_rm(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Destroy a sandbox and its checkpoints."""
    _guard(lambda: _client(socket).delete_sandbox(sandbox), as_json)
    _print_json({"removed": sandbox}) if as_json else out.print(f"removed {sandbox}")


@app.command("exec", context_settings={"allow_interspersed_args": False})
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
        res = _guard(lambda: _client(socket).exec(sandbox, command, env=envd or None, cwd=cwd, timeout=timeout,
                                                   stdin=stdin), as_json, exit_code=exec_exit_code)
    except typer.Exit:
        raise
    except Exception as e:  # crabd's own failure, whatever it is, is 125: never the command's code
        err.print(f"[red]error:[/red] {type(e).__name__}: {e}", highlight=False)
        raise typer.Exit(EXEC_CRABD_FAILED) from None
    if as_json:
        _print_json(res)
    else:
        sys.stdout.write(res["stdout"])
        sys.stderr.write(res["stderr"])
        if os.environ.get("CRABD_VERBOSE"):
            err.print(f"[dim]turn {res['turn']}: {res['plan']} -> {res['checkpoint']}[/dim]")
    raise typer.Exit(res["exit_code"])


@checkpoint_app.command("ls")
def checkpoint_ls(sandbox: str, all_states: bool = typer.Option(False, "--all", help="include failed ones"),
                  socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List a sandbox's checkpoints (the current head is marked)."""
    cks = _guard(lambda: _client(socket).checkpoints(sandbox, all=all_states), as_json)
    if as_json:
        _print_json({"checkpoints": cks})
        return
    for c in cks:
        c["head"] = "*" if c.get("head") else ""
        c["pause_ms"] = f"{1000 * c['durations'].get('pause', 0):.1f}" if c.get("durations") else "-"
        c["kept"] = ", ".join(c.get("kept") or []) or ("retire" if c["state"] == "committed" else "")
    _table(cks, ["head", "seq", "id", "turn", "branch", "plan", "state", "bytes", "pause_ms", "kept"])


@checkpoint_app.command("inspect")
def checkpoint_inspect(checkpoint: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show a checkpoint with its Effects, Plan, sizes and timings."""
    _show(_guard(lambda: _client(socket).checkpoint(checkpoint), as_json), as_json)


@checkpoint_app.command("create")
def checkpoint_create(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Checkpoint a sandbox now (file system, whatever the inspector saw)."""
    ck = _guard(lambda: _client(socket).create_checkpoint(sandbox), as_json)
    _print_json(ck) if as_json else out.print(f"{ck['id']} {ck['state']} ({ck['bytes']} bytes)")


@checkpoint_app.command("rm")
def checkpoint_rm(checkpoint: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Delete a checkpoint (not the head, not one with children)."""
    _guard(lambda: _client(socket).delete_checkpoint(checkpoint), as_json)
    _print_json({"removed": checkpoint}) if as_json else out.print(f"removed {checkpoint}")


@checkpoint_app.command("push")
def checkpoint_push(checkpoint: str, reference: str, registry_auth: Optional[str] = RegistryAuthOpt,
                    insecure: bool = InsecureOpt, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Push a checkpoint to an OCI registry as REFERENCE (HOST[:PORT]/REPO[:TAG]); blobs it has are skipped."""
    r = _guard(lambda: _client(socket).push_checkpoint(checkpoint, reference, registry_auth=registry_auth,
                                                       insecure=insecure), as_json)
    _print_json(r) if as_json else out.print(
        f"{r['pinned']}  ({r['blobs_pushed']} blobs pushed, {r['blobs_skipped']} skipped, "
        f"{r['bytes_pushed']} of {r['bytes_total']} bytes sent)")


@checkpoint_app.command("diff")
def checkpoint_diff(a: str, b: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Files added, modified and deleted from checkpoint A to checkpoint B."""
    d = _guard(lambda: _client(socket).diff(a, b), as_json)
    if as_json:
        _print_json(d)
    else:
        _table(d["changes"], ["kind", "path", "type", "size"])


@app.command()
def rollback(sandbox: str, to: Optional[str] = typer.Option(None, "--to", help="checkpoint id or seq",
                                                           show_default="the latest complete one"),
             socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Roll a sandbox back to a checkpoint; a new branch starts there."""
    r = _guard(lambda: _client(socket).rollback(sandbox, to), as_json)
    if as_json:
        _print_json(r)
        return
    out.print(f"{r['sandbox']} rolled back to {r['checkpoint']} (turn {r['turn']}, branch {r['branch']}) "
              f"in {r['duration_ms']:.0f} ms")
    for e in r["effects_not_undone"]:
        out.print(f"[yellow]not undone:[/yellow] turn {e['turn']}: {'; '.join(e['reasons']) or 'unknown effects'}")


@app.command()
def fork(checkpoint: str, count: int = typer.Option(1, "--count"),
         to: Optional[str] = typer.Option(None, "--to", help="fork onto another daemon through this registry "
                                          "reference (HOST[:PORT]/REPO[:TAG]): push here, create there"),
         target_socket: Optional[Path] = typer.Option(None, "--target-socket", help="with --to: the other "
                                                      "daemon's API socket"),
         registry_auth: Optional[str] = RegistryAuthOpt, insecure: bool = InsecureOpt,
         socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Create COUNT new sandboxes from a checkpoint (tree search); with --to, on another daemon."""
    if to is not None:
        r = _guard(lambda: _fork_to(checkpoint, count, to, target_socket, registry_auth, insecure, socket), as_json)
        _print_json(r) if as_json else out.print("\n".join(r["sandboxes"]))
        return
    with err.status(f"forking {checkpoint} x{count} ..."):
        r = _guard(lambda: _client(socket).fork(checkpoint, count), as_json)
    _print_json(r) if as_json else out.print("\n".join(r["sandboxes"]))


def _fork_to(checkpoint: str, count: int, ref: str, target_socket: Optional[Path], registry_auth: Optional[str],
             insecure: bool, socket: Optional[Path]) -> dict[str, Any]:
    """The source keeps running: its checkpoint is pushed once (pinned by
    digest), then the target daemon creates COUNT sandboxes from it."""
    if target_socket is None:
        from .errors import InvalidArgument
        raise InvalidArgument("--to needs --target-socket (the daemon to fork onto)")
    pushed = _client(socket).push_checkpoint(checkpoint, ref, registry_auth=registry_auth, insecure=insecure)
    target = _client(target_socket)
    made = [target.pull_sandbox(pushed["pinned"], registry_auth=registry_auth, insecure=insecure)
            for _ in range(count)]
    return {"checkpoint": checkpoint, "reference": pushed["pinned"], "push": pushed,
            "sandboxes": [m["sandbox"] for m in made], "created": made}


@sandbox_app.command("migrate")
def sandbox_migrate(sandbox: str,
                    to: str = typer.Option(..., "--to", help="the registry reference to move it through "
                                           "(HOST[:PORT]/REPO[:TAG])"),
                    target_socket: Path = typer.Option(..., "--target-socket", help="the target daemon's API socket"),
                    registry_auth: Optional[str] = RegistryAuthOpt, insecure: bool = InsecureOpt,
                    socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Live-migrate a sandbox to another daemon: pre-copy, freeze, push the delta, restore there; the source
    goes only once the target runs it (on any failure it keeps running here)."""
    r = _guard(lambda: _client(socket).migrate_sandbox(sandbox, to, target_socket.absolute(),
                                                       registry_auth=registry_auth, insecure=insecure), as_json)
    _print_json(r) if as_json else out.print(
        f"{r['sandbox']} -> {r['target_sandbox']} ({r['status']}, restored {r['restored']}) through "
        f"{r['reference']}; downtime {r['downtime_ms']:.0f} ms")


@app.command()
def events(sandbox: Optional[str] = typer.Option(None, "--sandbox"), follow: bool = typer.Option(False, "--follow", "-f"),
           since: int = typer.Option(0, "--since", help="only events after this seq (page by page, all of them)"),
           latest: Optional[int] = typer.Option(None, "--latest", "-n", min=1, max=1000,
                                                help="only the newest N (with --follow: then the new ones)"),
           socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the daemon's events (rollbacks, deaths, checkpoints): all after
    --since, or the newest --latest N; --follow goes on with new ones."""
    c = _client(socket)

    def show(e: dict[str, Any]) -> None:
        if as_json:
            print(json.dumps(e), flush=True)
        else:
            import datetime
            ts = datetime.datetime.fromtimestamp(e["ts"]).strftime("%H:%M:%S")
            out.print(f"{e['seq']:>6} {ts} {e['sandbox_id'] or '-':14} {e['kind']:22} "
                      f"{json.dumps(e['data'])[:60]}", highlight=False)

    # Pages through the cursor the daemon returns (a page holds at most 1,000).
    page = _guard(lambda: c.events_page(since, sandbox, latest=latest), as_json)
    for e in page["events"]:
        show(e)
    while latest is None and page["more"]:
        page = _guard(lambda: c.events_page(page["next"], sandbox), as_json)
        for e in page["events"]:
            show(e)
    if follow:
        try:
            for e in c.follow_events(page["next"], sandbox):
                show(e)
        except KeyboardInterrupt:
            return


@app.command()
def ui(port: int = typer.Option(0, "--port", help="local TCP port (0: a free one)"),
       host: str = typer.Option("127.0.0.1", "--host", help="address to listen on; keep it local"),
       token_file: Optional[Path] = typer.Option(None, "--token-file",
                                                 help="act as this owner (a token of crabd's tokens_file)"),
       socket: Optional[Path] = SocketOpt) -> None:
    """Open the operator view: a local port forwarded to the daemon's socket.
    Prints the URL to open (its #token= part is this session's key); runs
    until Ctrl-C. From another machine: ssh -L 8080:127.0.0.1:PORT HOST."""
    import asyncio
    from .ui.forward import Forwarder

    c = _client(socket)
    _guard(c.health, False)  # a daemon answers there, or say how to start one
    bearer = _guard(lambda: _read_token(token_file), False) if token_file else None

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
    from .errors import FailedPrecondition
    try:
        return path.read_text().strip()
    except OSError as e:
        raise FailedPrecondition(f"cannot read {path}: {e}", fix="pass a file that holds one token") from e


# --- effects ledger and budgets (crabd/effects.py) -----------------------------------------
effects_app = typer.Typer(no_args_is_help=True, help="Effects ledger: external calls made replay-safe.")
budget_app = typer.Typer(no_args_is_help=True, help="Budgets per sandbox lineage: turns, wall time, cost, retries.")
app.add_typer(effects_app, name="effects")
app.add_typer(budget_app, name="budget")
_EFFECT_COLS = ["id", "op", "key", "kind", "state", "turn", "checkpoint", "branch", "replays"]


def _json_arg(text: Optional[str], what: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as e:
        from .errors import InvalidArgument
        raise InvalidArgument(f"{what} is not JSON: {e}", fix=f"quote it, e.g. {what} '{{\"to\": \"bob\"}}'") from e


@effects_app.command("ls")
def effects_ls(sandbox: str, state: Optional[List[str]] = typer.Option(None, "--state", help="intent|committed|failed|unknown (repeatable)"),
               op: Optional[str] = typer.Option(None, "--op"),
               lineage: bool = typer.Option(False, "--lineage", help="every sandbox of the lineage"),
               socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List a sandbox's effects (managed ones and the unmanaged ones the inspector saw)."""
    rows = _guard(lambda: _client(socket).effects(sandbox, state=state, op=op, lineage=lineage), as_json)
    _print_json(rows) if as_json else _table(rows, _EFFECT_COLS)


@effects_app.command("intent")
def effects_intent(sandbox: str, op: str, key: Optional[str] = typer.Option(None, "--key", help="idempotency key"),
                   args: Optional[str] = typer.Option(None, "--args", help="the call's arguments as JSON"),
                   postcondition: Optional[str] = typer.Option(None, "--postcondition"),
                   volatile: Optional[List[str]] = typer.Option(None, "--volatile", help="argument name to ignore (repeatable)"),
                   force: bool = typer.Option(False, "--force", help="execute even if a match says otherwise"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Before an external call: prints execute (with a new effect id), replay (with the receipt), ask or reconcile."""
    d = _guard(lambda: _client(socket).effect_intent(sandbox, op, key=key, args=_json_arg(args, "--args"),
                                                     postcondition=postcondition, volatile=volatile or [],
                                                     force=force), as_json)
    if as_json:
        _print_json(d)
        return
    line = d["decision"]
    if d["decision"] == "execute":
        line += f" {d['effect']['id']}" + (" (retry)" if d.get("retry") else "")
    if d.get("matched"):
        line += f" (matches {d['matched']} by {d['matched_by']})"
    out.print(line, highlight=False)
    if d["decision"] == "replay":
        out.print(json.dumps(d.get("receipt")), highlight=False)


def _finish(verb: str, effect: str, socket: Optional[Path], as_json: bool, **kw: Any) -> None:
    c = _client(socket)
    fn = {"commit": c.effect_commit, "fail": c.effect_fail, "unknown": c.effect_unknown,
          "reconcile": c.effect_reconcile}[verb]
    e = _guard(lambda: fn(effect, **kw), as_json)
    _print_json(e) if as_json else out.print(f"{e['id']}: {e['state']}", highlight=False)


@effects_app.command("commit")
def effects_commit(effect: str, receipt: Optional[str] = typer.Option(None, "--receipt", help="JSON"),
                   result_digest: Optional[str] = typer.Option(None, "--result-digest"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """The external call succeeded: record its receipt."""
    _finish("commit", effect, socket, as_json, receipt=_guard(lambda: _json_arg(receipt, "--receipt"), as_json),
            result_digest=result_digest)


@effects_app.command("fail")
def effects_fail(effect: str, error: Optional[str] = typer.Option(None, "--error"),
                 socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """The external call certainly did not happen."""
    _finish("fail", effect, socket, as_json, error=error)


@effects_app.command("unknown")
def effects_unknown(effect: str, error: Optional[str] = typer.Option(None, "--error"),
                    socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """The outcome is not known (a timeout): reconcile it later."""
    _finish("unknown", effect, socket, as_json, error=error)


@effects_app.command("reconcile")
def effects_reconcile(effect: str, outcome: str = typer.Argument(..., help="committed | failed"),
                      receipt: Optional[str] = typer.Option(None, "--receipt", help="JSON"),
                      result_digest: Optional[str] = typer.Option(None, "--result-digest"),
                      error: Optional[str] = typer.Option(None, "--error"),
                      socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """After checking the outside world: settle an unknown effect."""
    _finish("reconcile", effect, socket, as_json, outcome=outcome,
            receipt=_guard(lambda: _json_arg(receipt, "--receipt"), as_json), result_digest=result_digest, error=error)


@effects_app.command("policy")
def effects_policy(sandbox: str, op: Optional[str] = typer.Argument(None, help="operation ('*': the default)"),
                   policy: Optional[str] = typer.Argument(None, help="replay | allow | ask"),
                   socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the lineage's per-operation policies, or set one (default: replay)."""
    c = _client(socket)
    if op is not None and policy is not None:
        _guard(lambda: c.set_effect_policy(sandbox, op, policy), as_json)
    pol = _guard(lambda: c.effect_policies(sandbox), as_json)
    if as_json:
        _print_json(pol)
    else:
        _table([{"op": k, "policy": v} for k, v in pol.items()] or [{"op": "*", "policy": "replay"}], ["op", "policy"])


def _budget_out(b: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(b)
        return
    rows = [{"budget": f, "used": b["used"][f], "limit": b["limits"][f]} for f in b["limits"]]
    _table(rows, ["budget", "used", "limit"])


@budget_app.command("show")
def budget_show(sandbox: str, socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the budget of the sandbox's lineage (limits and usage)."""
    _budget_out(_guard(lambda: _client(socket).budget(sandbox), as_json), as_json)


def _limit(text: Optional[str], name: str) -> Any:
    if text is None or text.lower() == "none":
        return None
    try:
        v = float(text)
    except ValueError:
        from .errors import InvalidArgument
        raise InvalidArgument(f"--{name} must be a number or 'none', not {text!r}") from None
    return int(v) if name in ("turns", "retries") and v.is_integer() else v


@budget_app.command("set")
def budget_set(sandbox: str,
               turns: Optional[str] = typer.Option(None, "--turns", help="max turns (execs); 'none' = no limit"),
               wall_s: Optional[str] = typer.Option(None, "--wall-s", help="max seconds of exec wall time"),
               cost: Optional[str] = typer.Option(None, "--cost", help="max cost units"),
               retries: Optional[str] = typer.Option(None, "--retries", help="max re-executions of failed effects"),
               socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Set limits of the lineage's budget; the options not given keep theirs."""
    given = {"turns": turns, "wall_s": wall_s, "cost": cost, "retries": retries}
    limits = _guard(lambda: {k: _limit(v, k.replace("_", "-")) for k, v in given.items() if v is not None}, as_json)
    _budget_out(_guard(lambda: _client(socket).set_budget(sandbox, **limits), as_json), as_json)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
