"""Agent traces: the recovery benchmark's input format.

A trace is one JSON file that replays an agent session in a sandbox:

    {"name": "calc-repair", "image": "debian-py", "description": "...",
     "setup": ["shell command", ...],            # before turn 1, not timed
     "inputs": ["click-8.1.7.tar.gz", ...],      # cached PyPI files, copied to /inputs/ first
     "files": {"/work/app.py": "content", ...},   # written before setup
     "turns": [{"run": "shell command", "llm_wait_ms": 2000}, ...],
     "check": [{"run": "...", "expect_exit": 0, "expect_stdout": "..."?}],
     "state_paths": ["/work"]}                    # trees whose digest must match

Loading a malformed trace names the field that is wrong
(`trace x.json: turns.3.run: Field required`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import InvalidArgument

__all__ = ["Trace", "Turn", "Check", "ExternalCall", "load_trace", "load_traces", "STATE_DIGEST"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExternalCall(_Model):
    """A call to the outside world the agent makes after the turn's command
    (a PR opened, a message sent): what no rollback can undo."""
    op: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")
    args: dict[str, Any] = Field(default_factory=dict)


class Turn(_Model):
    run: str = Field(min_length=1, description="shell command of this turn (run by /bin/sh -c)")
    llm_wait_ms: int = Field(2000, ge=0, le=600_000, description="the agent's LLM wait after this turn")
    expect_exit: int | None = Field(None, description="exit code the turn must have (None: any)")
    external: ExternalCall | None = Field(None, description="an external call made after the command")


class Check(_Model):
    run: str = Field(min_length=1)
    expect_exit: int = 0
    expect_stdout: str | None = None


class Trace(_Model):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    image: str = "debian-py"
    description: str = ""
    setup: list[str] = Field(default_factory=list)
    # File names from the bench's input cache (bench/inputs.py), copied into the
    # sandbox at /inputs/NAME before `files` and `setup`: sandboxes have no network.
    inputs: list[str] = Field(default_factory=list)
    files: dict[str, str] = Field(default_factory=dict)
    turns: list[Turn] = Field(min_length=1)
    check: list[Check] = Field(default_factory=list)
    state_paths: list[str] = Field(default_factory=list)

    @field_validator("inputs")
    @classmethod
    def _plain_names(cls, v):  # type: ignore[no-untyped-def]
        for n in v:
            if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$", n):
                raise ValueError(f"input {n!r} must be a plain file name (bench/inputs.py PINNED)")
        return v

    @field_validator("files", "state_paths")
    @classmethod
    def _absolute(cls, v):  # type: ignore[no-untyped-def]
        paths = v.keys() if isinstance(v, dict) else v
        for p in paths:
            if not p.startswith("/") or "/../" in p + "/" or "\0" in p:
                raise ValueError(f"path {p!r} must be absolute, without '..'")
        return v


# A Python script run in the sandbox: `python3 -c STATE_DIGEST PATH...` prints one
# sha256 over the trees' paths, modes, file contents and symlink targets (not
# mtimes; .git and __pycache__ skipped): what a correct recovery must reproduce.
STATE_DIGEST = r"""
import hashlib, os, sys
h = hashlib.sha256()
for top in sys.argv[1:]:
    for d, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs if x not in ('.git', '__pycache__'))
        h.update(b'D' + d.encode() + oct(os.lstat(d).st_mode).encode())
        for n in sorted(files) + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            st = os.lstat(p)
            h.update(p.encode() + oct(st.st_mode).encode())
            if os.path.islink(p):
                h.update(os.readlink(p).encode())
            elif os.path.isfile(p):
                h.update(open(p, 'rb').read())
print(h.hexdigest())
"""


def load_trace(path: Path | str) -> Trace:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"trace {p}: no such file") from None
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"trace {p}: not JSON: {e}") from None
    try:
        return Trace.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise InvalidArgument(f"trace {p.name}: {loc}: {err['msg']}",
                              fix="see 'Traces' in README.md for the format") from None


def load_traces(directory: Path | str) -> list[Trace]:
    files = sorted(Path(directory).glob("*.json"))
    if not files:
        raise InvalidArgument(f"no traces (*.json) in {directory}")
    return [load_trace(f) for f in files]
