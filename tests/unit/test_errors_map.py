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
