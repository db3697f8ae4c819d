"""The daemon's configuration file: /etc/crabd/config.toml.

`crabd serve --config FILE` loads a `Settings` from TOML (see
systemd/config.toml.sample for every key with its default). Precedence, from
weakest: built-in defaults < the file < environment < command line. This
module does the first three (`load_settings`, then `Settings.with_env`:
each top-level key KEY from $CRABD_KEY, e.g. CRABD_STATE_DIR,
CRABD_LOG_LEVEL, CRABD_INSPECTOR); the caller applies the flags with
`Settings.with_overrides`, which validates again, so an override is held to
the same rules as the file.

Not settings, and read from the environment where they are used: the host
layout of scripts/setup-host that library code needs without a daemon
(CRABD_PREFIX, CRABD_INIT, CRABD_RUNC, CRABD_CRIU, and CRABD_STATE_DIR as the
library's default state dir: crabd.config), the
clients' CRABD_SOCKET (and crabd-docker's CRABD_DOCKER_SOCKET and
CRABD_DOCKER_CLI), and test or benchmark hooks that must never be set in
a config file by mistake (CRABD_CHAOS*, CRABD_OVERLAY_MAX_DEPTH,
CRABD_ORACLE, CRABD_PYTHON, CRABD_VERBOSE, CRABD_BENCH_CACHE), and the
fast exec path's switch (CRABD_EXEC_CHANNEL, read by crabd.config: on by
default, `0` turns it off for new sandboxes).

Startup fails fast on a bad file (STYLE.md): an unknown key is an error that
names the key (a typo such as `keep_lst` must not silently keep the default),
and a bad value names the field, the value and the file.
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import SettingsError
from .scheduler import DEFAULT_IO_BUDGET, DEFAULT_LLM_WAIT, SchedulerPolicy

__all__ = [
    "Settings",
    "RetentionSettings",
    "SchedulerSettings",
    "SnapshotSettings",
    "SettingsError",
    "load_settings",
    "DEFAULT_CONFIG",
]

DEFAULT_CONFIG = Path("/etc/crabd/config.toml")


class _Section(BaseModel):
    # extra="forbid": unknown keys are errors, see the module docstring.
    model_config = ConfigDict(extra="forbid", frozen=True)


class RetentionSettings(_Section):
    """Which checkpoints of a sandbox survive GC (the newest always does)."""

    keep_last: int = Field(50, ge=1, description="keep the newest N checkpoints of each sandbox")
    keep_every: int = Field(10, ge=0, description="also keep every Mth checkpoint (by sequence); 0 = none")


class SchedulerSettings(_Section):
    """The host-scoped scheduler (crabd.scheduler.SchedulerPolicy)."""

    enabled: bool = Field(True, description="false: every checkpoint starts at once (the benchmark's baseline)")
    max_concurrency: int = Field(2, ge=1, description="jobs running at once, host-wide")
    max_background: int = Field(1, ge=1, description="compaction/compression/GC/standby jobs at once")
    io_budget_bytes: int = Field(DEFAULT_IO_BUDGET, ge=1, description="estimated bytes of checkpoint writes in flight")
    default_llm_wait: float = Field(DEFAULT_LLM_WAIT, gt=0, description="expected LLM wait (s) before any is observed")
    gap_smoothing: float = Field(0.3, gt=0, le=1, description="EMA weight of each newly observed gap")
    background_max_delay: float | None = Field(None, gt=0, description="run background work this old (s) even when busy")

    def policy(self) -> SchedulerPolicy:
        """The scheduler policy these settings describe (one per daemon)."""
        return SchedulerPolicy(
            max_concurrency=self.max_concurrency,
            io_budget_bytes=self.io_budget_bytes,
            max_background=self.max_background,
            default_wait=self.default_llm_wait,
            smoothing=self.gap_smoothing,
            enabled=self.enabled,
            background_max_delay=self.background_max_delay,
        )


class SnapshotSettings(_Section):
    driver: Literal["auto", "btrfs", "overlay"] = Field(
        "auto", description="auto: btrfs if the state dir is on btrfs or a loop pool works, else overlay"
    )
    pool_size_gib: float = Field(
        20, gt=0.25, description="size of the sparse loop-backed btrfs pool made at first start when the state "
        "dir is not on btrfs: every sandbox's disk (there is no per-sandbox quota)"
    )


class Settings(_Section):
    """Everything `crabd serve` reads from its configuration file."""

    state_dir: Path = Path("/var/lib/crabd")
    socket: Path = Path("/run/crabd/crabd.sock")
    docker_api: bool = Field(True, description="serve the Docker Engine API subset (crabd.dockerapi) on docker_socket")
    docker_socket: Path | None = Field(None, description="its unix socket [default: docker.sock next to socket]")
    tcp_listen: str | None = Field(None, description='"HOST:PORT" for an optional TCP API; needs token_file')
    token_file: Path | None = Field(None, description="file holding the bearer token for the TCP API")
    tokens_file: Path | None = Field(None, description='per-owner bearer tokens, "owner:token" lines (mode 0600)')
    auto_rollback: bool = Field(True, description="roll a sandbox that died back to its last checkpoint")
    death_poll_s: float = Field(1.0, gt=0, le=3600,
                                description="the death watch's safety-net poll (seconds); deaths are noticed at "
                                            "once through a pidfd of each sandbox's init")
    watchdog: bool = Field(True, description="ping systemd's watchdog when the unit sets WatchdogSec=")
    capture: Literal["auto", "fs-only", "full"] = Field(
        "auto", description="auto: the classifier's plan; fs-only: never dump processes; "
                            "full: an FS snapshot and a CRIU dump every turn, through the same store (baseline)")
    inspector: Literal["bpf", "proc"] = Field(
        "bpf", description="the turn inspector: bpf (eBPF tracepoints, compiled at start) or proc "
                           "(/proc scans: no BPF, coarser plans; API-level tests use it)")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "warning", description="the API server's (uvicorn's) log level")
    retention: RetentionSettings = RetentionSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    snapshot: SnapshotSettings = SnapshotSettings()

    @field_validator("state_dir", "socket", "token_file", "tokens_file", "docker_socket")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        # A relative path would resolve against systemd's cwd (/): say so now.
        if v is not None and not v.is_absolute():
            raise ValueError(f"must be an absolute path, got {str(v)!r}")
        return v

    @field_validator("socket", "docker_socket")
    @classmethod
    def _socket_fits(cls, v: Path | None) -> Path | None:
        # sockaddr_un.sun_path holds 108 bytes with the NUL: a longer path
        # fails only at bind() time, deep in startup, with a vaguer message.
        if v is not None and len(str(v).encode()) > 107:
            raise ValueError(f"unix socket path longer than 107 bytes: {str(v)!r}")
        return v

    @field_validator("tcp_listen")
    @classmethod
    def _host_port(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f'must be "HOST:PORT" (e.g. "127.0.0.1:7411"), got {v!r}')
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            if not bare.replace("-", "").replace(".", "").isalnum():
                raise ValueError(f"not an IP address or host name: {host!r}") from None
        return v

    @model_validator(mode="after")
    def _tcp_needs_token(self) -> "Settings":
        # The rule: TCP only with a bearer token; unix socket access is
        # gated by file mode, a TCP port by nothing else.
        if self.tcp_listen is not None and self.token_file is None and self.tokens_file is None:
            raise ValueError("tcp_listen is set but token_file is not (nor tokens_file): "
                             "the TCP API is served only with a bearer token")
        return self

    @property
    def docker_socket_path(self) -> Path | None:
        """Where the Docker API is served (None: not served)."""
        if not self.docker_api:
            return None
        return self.docker_socket or self.socket.parent / "docker.sock"

    @property
    def tcp_host_port(self) -> tuple[str, int] | None:
        """`tcp_listen` split for uvicorn, brackets of an IPv6 host removed."""
        if self.tcp_listen is None:
            return None
        host, _, port = self.tcp_listen.rpartition(":")
        return host.strip("[]"), int(port)

    def with_env(self, environ: Mapping[str, str] | None = None) -> "Settings":
        """A copy with each top-level key KEY taken from $CRABD_KEY where set
        (sections are file-only)."""
        env = os.environ if environ is None else environ
        found = {k: env[ENV_PREFIX + k.upper()] for k, f in type(self).model_fields.items()
                 if not _is_section(f.annotation) and env.get(ENV_PREFIX + k.upper())}
        try:
            return self.with_overrides(**found)
        except SettingsError as e:
            raise SettingsError(f"environment ({', '.join(ENV_PREFIX + k.upper() for k in found)}): {e.message}",
                                field=e.field, fix="fix or unset the variable") from None

    def with_overrides(self, **overrides: Any) -> "Settings":
        """A copy with top-level keys replaced (env/CLI), validated like the file.

        Keys whose value is None are ignored, so a CLI can pass its options
        through unconditionally. Nested sections are replaced by merging:
        `with_overrides(scheduler={"enabled": False})` keeps the other keys.
        """
        data = self.model_dump()
        for key, value in overrides.items():
            if value is None:
                continue
            if isinstance(value, BaseModel):
                value = value.model_dump()
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        try:
            return Settings.model_validate(data)
        except ValidationError as e:
            raise _convert(e, None) from None


ENV_PREFIX = "CRABD_"


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def load_settings(path: Path | str | None = None, *, missing_ok: bool = False) -> Settings:
    """Settings from a TOML file; defaults if `path` is None (or missing and `missing_ok`).

    `missing_ok` is for the default path (/etc/crabd/config.toml): a host
    with no config file runs on defaults, but a file named explicitly must
    exist.
    """
    if path is None:
        return Settings()
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return Settings()
        raise SettingsError(f"{path}: no such configuration file", path=path,
                            fix="create it (see systemd/config.toml.sample) or omit --config") from None
    except OSError as e:
        raise SettingsError(f"{path}: cannot read: {e.strerror}", path=path) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SettingsError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})", path=path) from None
    except tomllib.TOMLDecodeError as e:
        # tomllib's message carries "(at line L, column C)".
        raise SettingsError(f"{path}: not valid TOML: {e}", path=path) from None
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise _convert(e, path) from None


def _convert(e: ValidationError, path: Path | None) -> SettingsError:
    """One readable message per problem, each naming its key and the file."""
    where = f"{path}: " if path is not None else ""
    lines: list[str] = []
    first_field: str | None = None
    for err in e.errors(include_url=False):
        key = ".".join(str(p) for p in err["loc"])
        first_field = first_field or key or None
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        # Our own validators quote the value already; pydantic's do not.
        shown = "" if err["type"] == "value_error" or isinstance(value, dict) else f" (got {value!r})"
        # A cross-field rule has no single key; its message names the keys.
        lines.append(f"{key}: {msg}{shown}" if key else msg)
    return SettingsError(where + "; ".join(lines), path=path, field=first_field,
                         fix="see systemd/config.toml.sample for every key and its default")
