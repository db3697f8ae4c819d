"""bench/ as one package (issue 19): package imports only, no sys.path edits,
no import cycle among the recovery modules, and every benchmark's real options
in `crabd bench NAME --help` (the benchmark's own parser, with defaults)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import bench

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "bench"


def _tree(p: Path) -> ast.Module:
    return ast.parse(p.read_text(), str(p))


def test_no_bench_module_edits_sys_path() -> None:
    for p in sorted(BENCH.glob("*.py")):
        for n in ast.walk(_tree(p)):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "path" \
                    and getattr(n.value.value, "id", None) == "sys" and n.attr in ("insert", "append"):
                raise AssertionError(f"{p.name}:{n.lineno} edits sys.path; import through the bench package")


def _bench_imports(p: Path) -> set[str]:
    """The bench modules `p` imports (anywhere in it, lazily or not)."""
    out = set()
    for n in ast.walk(_tree(p)):
        if isinstance(n, ast.ImportFrom) and n.module:
            if n.module == "bench":
                out |= {a.name for a in n.names}
            elif n.module.startswith("bench."):
                out.add(n.module.split(".")[1])
        elif isinstance(n, ast.Import):
            out |= {a.name.split(".")[1] for a in n.names if a.name.startswith("bench.")}
    return out


def test_bench_modules_form_no_import_cycle() -> None:
    graph = {p.stem: _bench_imports(p) for p in BENCH.glob("*.py")}

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join(path + (m,))}"
        for d in graph.get(m, ()):
            visit(d, path + (m,))
    for m in graph:
        visit(m, ())
    assert "recovery" not in graph["recovery_chain"] | graph["recovery_report"] | graph["recovery_scale"]


@pytest.mark.parametrize("name", sorted(bench.COMMANDS))
def test_each_benchmark_has_a_parser_and_a_main(name: str) -> None:
    mod = importlib.import_module(f"bench.{bench.COMMANDS[name]}")
    ap = mod.parser()
    assert callable(mod.main)
    assert [a for a in ap._actions if a.option_strings and "--help" not in a.option_strings], name


def test_crabd_bench_help_shows_the_benchmarks_own_options_and_defaults() -> None:
    from typer.testing import CliRunner

    from crabd.cli import app
    r = CliRunner().invoke(app, ["bench", "recovery", "--help"])
    assert r.exit_code == 0, r.output
    for opt in ("--methods", "--faults", "--time-scale", "--chain", "--scale", "--inspector {bpf,proc}", "--out"):
        assert opt in r.output, opt
    assert "(default: 0.05)" in r.output and "usage: crabd bench recovery" in r.output
    r = CliRunner().invoke(app, ["bench", "--help"])
    assert r.exit_code == 0 and "check-traces" in r.output and "zdtm" in r.output, r.output


def test_crabd_bench_rejects_an_unknown_option_before_running() -> None:
    # a separate process: argparse exits, and the benchmark must not start
    p = subprocess.run([sys.executable, "-m", "crabd.cli", "bench", "fs", "--no-such-option"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "unrecognized arguments: --no-such-option" in p.stderr, p.stderr


def test_crabd_bench_finds_the_checkout_from_any_directory(tmp_path: Path) -> None:
    # bench is not installed: crabd loads it from the checkout beside its package
    p = subprocess.run([sys.executable, "-m", "crabd.cli", "bench", "cr", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and "--only {small,heap200,small_fs}" in p.stdout, p.stderr
