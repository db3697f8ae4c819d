"""The docs stay true to the code and to themselves (no root, ~2 s):

- docs/reference/*.md are what crabd._docgen renders from the code now
  (the typer app, the OpenAPI document, the settings model, the daemon's
  events, the metrics): a change to any of them without regenerating fails
  here with the command to run;
- every relative link in README.md and docs/ names a file that exists, and
  a `#anchor` names a heading of that file;
- README.md stays short (the details live in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from crabd import _docgen

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 200


@pytest.mark.parametrize("page", sorted(_docgen.PAGES))
def test_generated_reference_is_current(page: str) -> None:
    committed = _docgen.REFERENCE / page
    rendered = _docgen.PAGES[page]()
    assert committed.is_file(), f"docs/reference/{page} is missing: run {_docgen.REGENERATE}"
    assert committed.read_text() == rendered, (
        f"docs/reference/{page} is stale (the code it documents changed): run {_docgen.REGENERATE} "
        "and commit the result")


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # headings inside code blocks are not headings
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slug = _docgen._slug(re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out |= set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return [a or b for a, b in LINK.findall(text)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    bad = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{doc.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_readme_is_short() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def test_the_link_checker_catches_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n\n[ok](#two-words) [x](b.md) [y](#nope) "
                                   "`[not](a link)`\n")
    assert _links(tmp_path / "a.md") == ["#two-words", "b.md", "#nope"]
    assert "two-words" in _anchors(tmp_path / "a.md") and "nope" not in _anchors(tmp_path / "a.md")


def test_events_page_reads_literal_kinds_and_an_event_kind_enum(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's events come from `_event("kind", ...)` calls today and
    from an `EventKind` enum once crabd.daemon.events has one: the generator
    reads both (and f-string kinds), with the data fields of each call."""
    import enum

    src = tmp_path / "daemon.py"
    src.write_text(
        "class D:\n"
        "    def died(self, sid):\n"
        "        self._event('sandbox.died', sid, reason='x', after_recovery_to=None)\n"
        "    def ready(self, sid):\n"
        "        self._event(EventKind.STANDBY_READY, sid, checkpoint='c')\n"
        "    def decided(self, out):\n"
        "        self._event(f\"effect.{out['decision']}\", None, effect=1)\n")
    monkeypatch.setattr(_docgen, "_daemon_sources", lambda: [src])
    monkeypatch.setattr(_docgen, "ROOT", tmp_path)
    monkeypatch.setattr(_docgen, "_event_enum", lambda: None)
    page = _docgen.render_events()
    assert "| `sandbox.died` | `after_recovery_to`, `reason` | `daemon.died` |" in page
    assert "| `effect.{decision}` | `effect` | `daemon.decided` |" in page

    class EventKind(enum.StrEnum):
        SANDBOX_DIED = "sandbox.died"
        STANDBY_READY = "standby.ready"
        EFFECT_REPLAY = "effect.replay"

    monkeypatch.setattr(_docgen, "_event_enum", lambda: EventKind)
    page = _docgen.render_events()
    assert "| `standby.ready` | `checkpoint` | `daemon.ready` |" in page
    assert "| `sandbox.died` | `after_recovery_to`, `reason` | `daemon.died` |" in page
    assert "| `effect.replay` | `effect` | `daemon.decided` |" in page  # from the f-string kind
    assert "| `effect.{decision}`" not in page  # the enum is the list of kinds
