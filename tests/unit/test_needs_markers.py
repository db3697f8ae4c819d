"""Every integration test says which host features it needs (tests/conftest.py).

Read from the source, not by collecting: collecting the integration tests
would import what they import, and this check runs without root.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import FEATURES

INTEGRATION = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "integration"


def _needs(node: ast.AST) -> list[tuple[str, ...]]:
    """The feature lists of the `pytest.mark.needs(...)` calls in `node`."""
    out = []
    for call in ast.walk(node):
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "needs"
                and isinstance(call.func.value, ast.Attribute) and call.func.value.attr == "mark"):
            out.append(tuple(a.value for a in call.args if isinstance(a, ast.Constant)))
    return out


def needs_by_test(path: Path) -> dict[str, set[str]]:
    """Each test function of a file (top level or in a class) -> the features
    its markers and its file's `pytestmark` name."""
    tree = ast.parse(path.read_text())
    file_level: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            file_level |= {f for feats in _needs(node.value) for f in feats}
    out: dict[str, set[str]] = {}
    for node in tree.body:
        funcs = node.body if isinstance(node, ast.ClassDef) else [node]
        for fn in funcs:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name.startswith("test"):
                own = {f for d in fn.decorator_list for feats in _needs(d) for f in feats}
                out[fn.name] = file_level | own
    return out


def test_every_integration_test_says_what_it_needs():
    files = sorted(INTEGRATION.rglob("test_*.py"))
    assert files
    unmarked = [f"{p.relative_to(INTEGRATION)}::{name}" for p in files for name, feats in needs_by_test(p).items()
                if not feats]
    assert not unmarked, f"integration tests without a needs marker (tests/conftest.py): {unmarked}"


def test_only_known_features_are_named():
    named = {f for p in INTEGRATION.rglob("test_*.py") for feats in needs_by_test(p).values() for f in feats}
    assert named <= set(FEATURES), named - set(FEATURES)


def test_a_test_without_a_marker_is_found(tmp_path):
    p = tmp_path / "test_x.py"
    p.write_text("import pytest\n\n@pytest.mark.needs('runc')\ndef test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    assert needs_by_test(p) == {"test_a": {"runc"}, "test_b": set()}
