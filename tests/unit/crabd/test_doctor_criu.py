"""`crabd doctor`'s CRIU check is deltacr's (cached, the daemon's own), not a
second implementation: what deltacr finds missing is what doctor reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import deltacr
from crabd import doctor
from deltacr.runc import CriuInfo


def test_doctor_reports_deltacrs_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def missing(runner: Any, *a: Any) -> CriuInfo:
        calls.append(runner)
        raise deltacr.CriuUnavailable("CRIU at criu cannot be used: missing a passing `criu check`",
                                      missing=["a passing `criu check`"], fix="run scripts/setup-host")
    monkeypatch.setattr(deltacr, "check_criu", missing)
    c = doctor.check_criu(Path("/nonexistent"))
    assert (c.status, c.fix) == (doctor.FAIL, "run scripts/setup-host") and "criu check" in c.detail
    assert len(calls) == 1

    monkeypatch.setattr(deltacr, "check_criu", lambda runner, *a: CriuInfo("criu", (4, 1, 1), frozenset()))
    c = doctor.check_criu(Path("/nonexistent"))
    assert c.status == doctor.OK and "CRIU 4.1.1" in c.detail
