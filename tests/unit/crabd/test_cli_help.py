"""The CLI's help and exit codes, without a daemon: defaults shown (Rich
once took "[default: ...]" in a help string for markup and dropped it),
`--capture` a choice, `crabd exec`'s exit codes mapped as `docker exec`'s."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from crabd import cli
from crabd.capture import MODES
from crabd.errors import CommandNotExecutable, CommandNotFound, ExecTimeout, NotFound


def _help(*args: str) -> str:
    r = CliRunner().invoke(cli.app, [*args, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return r.output


def test_help_shows_the_defaults() -> None:
    serve = _help("serve")
    assert "/var/lib/crabd" in serve and "/run/crabd/crabd.sock" in serve and "/etc/crabd/config.toml" in serve
    assert "the latest complete one" in _help("rollback")
    assert "/run/crabd/crabd.sock" in _help("exec")


def test_capture_is_a_choice() -> None:
    assert {c.value for c in cli.CaptureChoice} == set(MODES)
    assert "auto|fs-only|full" in _help("serve")
    r = CliRunner().invoke(cli.app, ["serve", "--capture", "everything"])
    assert r.exit_code == 2 and "everything" in r.output


class _FakeClient:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def exec(self, *a: Any, **kw: Any) -> dict[str, Any]:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return {"exit_code": self.outcome, "stdout": "", "stderr": "", "turn": 1, "plan": "SKIP", "checkpoint": "c"}


@pytest.mark.parametrize("outcome, code", [
    (0, 0), (3, 3), (137, 137),
    (CommandNotFound("command 'x' not found"), 127),
    (CommandNotExecutable("'x' is not executable"), 126),
    (NotFound("no sandbox 'sb'"), 125),
    (ExecTimeout("did not finish"), 125),
    (ConnectionRefusedError("no daemon"), 125),
])
def test_exec_exit_codes_follow_docker(monkeypatch: pytest.MonkeyPatch, outcome: Any, code: int) -> None:
    monkeypatch.setattr("crabd.client.Client", lambda socket: _FakeClient(outcome))  # what the CLI builds
    r = CliRunner().invoke(cli.app, ["exec", "sb", "--", "x"])
    assert r.exit_code == code, r.output
