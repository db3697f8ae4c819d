"""The `crabd` command line.

Every command that reports has `--json`; every command that touches state
takes `--state-dir` (or $CRABD_STATE_DIR). Errors print what went wrong and
how to fix it, on stderr, and exit 1 (2 for bad usage).

Sandbox commands here drive `crabd.runtime` directly on the state directory;
once the daemon is running they are meant to go through its socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import __version__, config
from .errors import CrabdError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="crabd: recoverable sandboxes for AI agents (checkpoint, roll back, fork).")
image_app = typer.Typer(no_args_is_help=True, help="Images: root file systems sandboxes start from.")
sandbox_app = typer.Typer(no_args_is_help=True, help="Sandboxes: runc containers agents run commands in.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (see bench/ and README.md).")
app.add_typer(image_app, name="image")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(bench_app, name="bench")

out = Console(width=int(os.environ.get("COLUMNS", "100")))
err = Console(stderr=True)

StateDir = typer.Option(None, "--state-dir", envvar="CRABD_STATE_DIR",
                        help="crabd's state directory [default: /var/lib/crabd]")
JsonOpt = typer.Option(False, "--json", help="print JSON instead of a table")


def _state(state_dir: Optional[Path]) -> Path:
    return state_dir or config.DEFAULT_STATE_DIR


def _fail(e: CrabdError, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": {"code": e.code, "message": e.message, "fix": e.fix}}))
    else:
        err.print(f"[red]error:[/red] {e.message}", highlight=False)
        if e.fix:
            err.print(f"[yellow]fix:[/yellow] {e.fix}", highlight=False)
    raise typer.Exit(1)


def _guard(fn: Callable[[], Any], as_json: bool) -> Any:
    try:
        return fn()
    except CrabdError as e:
        _fail(e, as_json)
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
def serve(config_file: Optional[Path] = typer.Option(None, "--config", help="TOML settings [default: /etc/crabd/config.toml if it exists]"),
          state_dir: Optional[Path] = StateDir,
          socket: Optional[Path] = typer.Option(None, "--socket", envvar="CRABD_SOCKET", help="API unix socket [default: /run/crabd/crabd.sock]"),
          no_auto_rollback: bool = typer.Option(False, "--no-auto-rollback", help="do not roll back sandboxes that die"),
          no_scheduler: bool = typer.Option(False, "--no-scheduler", help="start every checkpoint at once (benchmark baseline)")) -> None:
    """Run the crabd daemon (root): REST API on a unix socket."""
    import asyncio
    import logging
    from .serve import serve as run
    from .settings import load_settings
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s crabd %(levelname)s %(message)s")
    def build():  # type: ignore[no-untyped-def]
        path = config_file or Path("/etc/crabd/config.toml")
        s = load_settings(path, missing_ok=config_file is None)
        return s.with_overrides(state_dir=state_dir, socket=socket,
                                auto_rollback=False if no_auto_rollback else None,
                                scheduler={"enabled": False} if no_scheduler else None)
    settings = _guard(build, False)
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


# --- sandboxes -------------------------------------------------------------------------
@sandbox_app.command("create")
def sandbox_create(image: str, name: Optional[str] = typer.Option(None, "--name"),
                   memory_mb: int = typer.Option(2048, "--memory-mb", help="memory limit (0 = none)"),
                   pids: int = typer.Option(1024, "--pids", help="process limit (0 = none)"),
                   cpus: float = typer.Option(0.0, "--cpus", help="CPU limit in cores (0 = none)"),
                   state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Create and start a sandbox from an image."""
    from .runtime import Limits
    rt = _runtime(state_dir)
    lim = Limits(memory_bytes=memory_mb * 1024**2 or None, pids=pids or None, cpus=cpus or None)
    sb = _guard(lambda: rt.create(image, name=name, limits=lim), as_json)
    if as_json:
        _print_json(sb.to_dict())
    else:
        out.print(f"{sb.id}  ({sb.name}, {sb.status})")


@sandbox_app.command("ls")
def sandbox_ls(state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """List sandboxes."""
    rt = _runtime(state_dir)
    sbs = _guard(rt.list, as_json)
    if as_json:
        _print_json({"sandboxes": [s.to_dict() for s in sbs]})
        return
    t = Table(box=None, header_style="bold")
    for col in ("id", "name", "image", "status", "pid"):
        t.add_column(col)
    for s in sbs:
        t.add_row(s.id, s.name, s.image, s.status, str(s.pid or "-"))
    out.print(t)


@sandbox_app.command("inspect")
def sandbox_inspect(sandbox: str, state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Show one sandbox."""
    rt = _runtime(state_dir)
    sb = _guard(lambda: rt.get(sandbox), as_json)
    data = sb.to_dict()
    data["pids"] = rt.pids(sb.id)
    if as_json:
        _print_json(data)
    else:
        for k, v in data.items():
            out.print(f"[bold]{k}[/bold]: {v}", highlight=False)


@sandbox_app.command("stop")
def sandbox_stop(sandbox: str, state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Kill a sandbox's processes (its files stay; `start` runs a fresh init)."""
    rt = _runtime(state_dir)
    sb = _guard(lambda: rt.stop(sandbox), as_json)
    _print_json(sb.to_dict()) if as_json else out.print(f"{sb.id} {sb.status}")


@sandbox_app.command("start")
def sandbox_start(sandbox: str, state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Start a stopped sandbox with a fresh init."""
    rt = _runtime(state_dir)
    sb = _guard(lambda: rt.start(sandbox), as_json)
    _print_json(sb.to_dict()) if as_json else out.print(f"{sb.id} {sb.status}")


@sandbox_app.command("rm")
def sandbox_rm(sandbox: str, state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Destroy a sandbox: kill, unmount, delete."""
    rt = _runtime(state_dir)
    _guard(lambda: rt.destroy(sandbox), as_json)
    _print_json({"removed": sandbox}) if as_json else out.print(f"removed {sandbox}")


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(sandbox: str, cmd: List[str] = typer.Argument(..., help="command and arguments (after --)"),
          timeout: float = typer.Option(600.0, "--timeout"), cwd: Optional[str] = typer.Option(None, "--cwd"),
          env: List[str] = typer.Option([], "--env", help="K=V, repeatable"),
          shell: bool = typer.Option(False, "--shell", help="run CMD as one /bin/sh -c string"),
          state_dir: Optional[Path] = StateDir, as_json: bool = JsonOpt) -> None:
    """Run a command in a sandbox; exits with the command's exit code."""
    rt = _runtime(state_dir)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        err.print("[red]error:[/red] no command given: crabd exec SANDBOX -- CMD [ARGS...]")
        raise typer.Exit(2)
    envd = {}
    for e in env:
        k, sep, v = e.partition("=")
        if not sep:
            err.print(f"[red]error:[/red] --env {e!r} is not K=V")
            raise typer.Exit(2)
        envd[k] = v
    stdin = None if sys.stdin is None or sys.stdin.isatty() else sys.stdin.buffer.read()
    command: Any = " ".join(cmd) if shell else list(cmd)
    res = _guard(lambda: rt.exec(sandbox, command, env=envd, cwd=cwd, timeout=timeout, stdin=stdin), as_json)
    if as_json:
        _print_json(res.to_dict())
    else:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
    raise typer.Exit(res.exit_code)


# --- benchmarks ------------------------------------------------------------------------
def _bench(script: str, args: list[str]) -> None:
    path = Path(__file__).resolve().parent.parent / "bench" / script
    if not path.is_file():
        err.print(f"[red]error:[/red] benchmark {path} not found (benchmarks run from a source checkout)")
        raise typer.Exit(2)
    raise typer.Exit(subprocess.call([sys.executable, str(path), *args]))


_BENCH_CTX = {"allow_extra_args": True, "ignore_unknown_options": True}


@bench_app.command("fs", context_settings=_BENCH_CTX)
def bench_fs(ctx: typer.Context) -> None:
    """deltafs commit/rollback/fork latency (bench/fs.py; --quick, --json)."""
    _bench("fs.py", ctx.args)


@bench_app.command("inspector", context_settings=_BENCH_CTX)
def bench_inspector(ctx: typer.Context) -> None:
    """eBPF inspector overhead and accuracy (bench/inspector.py; --quick, --json)."""
    _bench("inspector.py", ctx.args)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
