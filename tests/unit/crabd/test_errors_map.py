"""crabd's errors are all in crabd.errors, each with its own code, and the
client raises the class the daemon raised, for every class (the client's map
is derived from the classes: IntegrityError, BudgetExceeded, SettingsError and
CommandNotExecutable were once outside it and came back as CrabdError)."""

from __future__ import annotations

import httpx
import pytest

from crabd import errors as E
from crabd.client import _raise


def _classes() -> list[type[E.CrabdError]]:
    return [c for c in (getattr(E, n) for n in E.__all__) if isinstance(c, type) and issubclass(c, E.CrabdError)]


def test_every_error_class_has_its_own_code() -> None:
    codes = [c.code for c in _classes()]
    assert len(codes) == len(set(codes)), codes
    assert set(E.by_code().values()) == set(_classes())


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_the_client_raises_the_daemons_class(cls: type[E.CrabdError]) -> None:
    body = {"error": {"code": cls.code, "message": "what went wrong", "fix": "how to fix it"}}
    with pytest.raises(E.CrabdError) as ei:
        _raise(httpx.Response(cls.http_status, json=body))
    assert type(ei.value) is cls
    assert ei.value.message == "what went wrong" and ei.value.code == cls.code
    if cls is not E.ExecTimeout:   # its wire form carries the output, not a fix
        assert ei.value.fix == "how to fix it"


def test_moved_classes_keep_their_old_import_paths() -> None:
    from crabd.effects import BudgetExceeded
    from crabd.settings import SettingsError
    from crabd.store import IntegrityError
    assert (BudgetExceeded, SettingsError, IntegrityError) == (E.BudgetExceeded, E.SettingsError, E.IntegrityError)


def test_library_errors_reach_the_client_by_their_crabd_class() -> None:
    """deltacr and deltafs keep their own error classes (they never import
    crabd); crabd.errors.from_library is where they become crabd's, so a
    deltacr.CommandFailed is caught as crabd's CommandFailed, with its argv."""
    import deltacr.errors as CR
    import deltafs.errors as FS
    got = E.from_library(CR.CommandFailed(["runc", "checkpoint", "sb-1"], 1, "a\nno such container\n",
                                          context="runc checkpoint of sb-1"))
    assert type(got) is E.CommandFailed
    assert (got.argv, got.returncode, got.stderr) == (["runc", "checkpoint", "sb-1"], 1, "a\nno such container\n")
    assert got.message.startswith("runc checkpoint of sb-1 failed (exit 1): ")
    assert type(E.from_library(CR.CriuUnavailable("CRIU 3.17 is too old", fix="run scripts/setup-host"))) \
        is E.FailedPrecondition
    assert type(E.from_library(CR.ImageCorrupted("sb-1@3", "chunk digest"))) is E.IntegrityError
    assert type(E.from_library(FS.NotFound("no snapshot 'x'"))) is E.NotFound
    crash = E.from_library(CR.CriuFailed("dump", errors=["Error (criu/cr-dump.c:1): boom"]))
    assert type(crash) is E.CrabdError and "boom" in crash.message
    assert E.from_library(ValueError("x")) is None


def test_the_api_answers_a_library_error_with_its_crabd_code() -> None:
    import asyncio
    from types import SimpleNamespace

    import deltacr.errors as CR
    from crabd.api import make_app

    token = "admin-token-0123456789"
    # the route below never touches the daemon
    app = make_app(SimpleNamespace(ledger=None), token=token)  # type: ignore[arg-type]

    @app.get("/v1/boom")
    async def boom() -> None:
        raise CR.CommandFailed(["runc", "restore"], 2, "cannot restore", context="runc restore of sb-1")

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://crabd") as c:
            return await c.get("/v1/boom", headers={"authorization": f"Bearer {token}"})

    r = asyncio.run(get())
    assert r.status_code == 500 and r.json()["error"]["code"] == "command_failed"
    with pytest.raises(E.CommandFailed, match="runc restore of sb-1 failed"):
        _raise(r)
