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

Layout: a module per command group (daemon, images, sandboxes, checkpoints,
effects; benchmarks in crabd/cli_bench.py), what they share in _common.
This module is the app's command table, in the order `crabd --help` lists
it; docs/reference/cli.md is rendered from it.
"""

from __future__ import annotations

import typer

from ..cli_bench import BenchGroup
from . import checkpoints, daemon, effects, images, sandboxes
from .daemon import CaptureChoice
from .sandboxes import exec_exit_code

__all__ = ["app", "main", "CaptureChoice", "exec_exit_code"]

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="crabd: recoverable sandboxes for AI agents (checkpoint, roll back, fork).")
app.command()(daemon.version)
app.command()(daemon.doctor)
app.command()(daemon.serve)
app.command("exec", context_settings={"allow_interspersed_args": False})(sandboxes.exec_)
app.command()(checkpoints.rollback)
app.command()(checkpoints.fork)
app.command()(daemon.events)
app.command()(daemon.ui)
app.add_typer(images.image_app, name="image")
app.add_typer(sandboxes.sandbox_app, name="sandbox")
app.add_typer(typer.Typer(cls=BenchGroup, no_args_is_help=True,
                          help="Benchmarks of a source checkout (bench/; `crabd bench NAME --help`)."), name="bench")
app.add_typer(checkpoints.checkpoint_app, name="checkpoint")
app.add_typer(effects.effects_app, name="effects")
app.add_typer(effects.budget_app, name="budget")


def main() -> None:
    app()
