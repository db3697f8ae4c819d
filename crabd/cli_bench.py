"""`crabd bench NAME`: the benchmarks of a source checkout (bench/), each
with its real options in `--help`.

Each benchmark module keeps its own `parser()` (argparse: `python -m
bench.NAME` works the same) and `main(argv)`. `crabd bench NAME` runs that
`main` in this process, and `crabd bench NAME --help` prints that parser's
help, with every option and its default: one definition of each option, no
copy in a docstring or a second option list to keep in step.

Layering: crabd never imports bench at import time. The bench package is
not installed (it is not in the wheel); it is loaded from the checkout next
to this crabd package, and only when a benchmark command is asked for.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from .errors import CrabdError, FailedPrecondition

__all__ = ["BenchGroup"]

_CHECKOUT_BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_package() -> ModuleType:
    """The checkout's `bench` package (already imported, or loaded from the
    directory next to crabd's: no sys.path edit)."""
    if "bench" in sys.modules:
        return sys.modules["bench"]
    init = _CHECKOUT_BENCH / "__init__.py"
    if not init.is_file():
        raise FailedPrecondition(f"no benchmarks at {_CHECKOUT_BENCH} (crabd is installed without its source tree)",
                                 fix="run `crabd bench` from a git checkout of crabd (pip install -e .)")
    spec = importlib.util.spec_from_file_location("bench", init, submodule_search_locations=[str(_CHECKOUT_BENCH)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = mod
    spec.loader.exec_module(mod)
    return mod


def _shown(default: Any) -> bool:
    return default not in (None, False, "", [], argparse.SUPPRESS)


class _HelpFormat(argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and each option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if action.option_strings and _shown(action.default) and "%(default)" not in h:
            h += (" " if h else "") + "(default: %(default)s)"
        return h


def bench_parser(name: str, module: ModuleType) -> argparse.ArgumentParser:
    """The benchmark's own parser, named `crabd bench NAME`, showing defaults."""
    ap: argparse.ArgumentParser = module.parser()
    ap.prog, ap.formatter_class = f"crabd bench {name}", _HelpFormat
    for a in ap._actions:   # argparse prints no help line, so no default, for an option without help
        if a.help is None and a.option_strings and _shown(a.default):
            a.help = "(default: %(default)s)"
    return ap


class BenchCommand(TyperCommand):
    """One benchmark: its parser shows the help and reads the arguments, its
    `main(argv)` runs."""

    def __init__(self, name: str, module: ModuleType) -> None:
        super().__init__(name, short_help=self._first_line(module), add_help_option=False,
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
        self.module = module

    @staticmethod
    def _first_line(module: ModuleType) -> str:
        return (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")

    def get_help(self, ctx: Any) -> str:
        return bench_parser(str(self.name), self.module).format_help()

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta["bench.argv"] = list(args)
        return []

    def invoke(self, ctx: Any) -> Any:
        ap = bench_parser(str(self.name), self.module)
        argv = ctx.meta["bench.argv"]
        if "-h" in argv or "--help" in argv:
            print(ap.format_help(), end="")
            raise typer.Exit(0)
        ap.parse_args(argv)   # bad usage: argparse's message and exit 2, before any work
        try:
            rc = self.module.main(argv)
        except CrabdError as e:
            typer.echo(f"error: {e.message}" + (f"\nfix: {e.fix}" if e.fix else ""), err=True)
            raise typer.Exit(1) from None
        raise typer.Exit(rc or 0)


class BenchGroup(TyperGroup):
    """`crabd bench`: one command per module in bench.COMMANDS, loaded on use."""

    def list_commands(self, ctx: Any) -> list[str]:
        try:
            return sorted(_bench_package().COMMANDS)
        except CrabdError:
            return []

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        try:
            pkg = _bench_package()
        except CrabdError as e:
            typer.echo(f"error: {e.message}\nfix: {e.fix}", err=True)
            raise typer.Exit(2) from None
        mod = pkg.COMMANDS.get(cmd_name)
        if mod is None:
            return None
        try:
            return BenchCommand(cmd_name, importlib.import_module(f"bench.{mod}"))
        except ImportError as e:  # a benchmark's own dependency (matplotlib, langgraph: the dev extra)
            msg = f"bench/{mod}.py cannot be imported: {e}; fix: pip install -e '.[dev]'"

            def unavailable() -> None:
                typer.echo(f"error: {msg}", err=True)
                raise typer.Exit(2)
            return TyperCommand(cmd_name, callback=unavailable, help=msg, short_help="(unavailable) " + msg)
