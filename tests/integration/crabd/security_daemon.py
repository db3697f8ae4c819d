"""One live daemon per test module for the security tests (test_access,
test_api_fuzz, test_tamper): TCP with an admin token_file and a per-owner
tokens_file, the /proc inspector (CRABD_INSPECTOR=proc: these tests are
about the API and stored state, not turn classification, and compiling the
BPF inspector costs 15-30 s of a loaded host per start)."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Iterator

import httpx

ADMIN = "admin-" + "a" * 26
ALICE = "alice-" + "b" * 26
BOB = "bob-" + "c" * 28


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def security_daemon(runtime: Any, images: tuple[str, ...] = ("busybox",), env: dict[str, str] | None = None,
                    config: str = "") -> Iterator[tuple[Any, str]]:
    """(DaemonHandle, "http://127.0.0.1:PORT"); sandboxes destroyed and the
    state dir removed afterwards."""
    from crabd.runtime import Runtime
    from crabd.testing import DaemonHandle, cleanup_state_dir
    st = Path(tempfile.mkdtemp(prefix="crabd-sec-", dir="/var/tmp"))
    conf = Path(tempfile.mkdtemp(prefix="crabd-sec-conf-"))
    d = None
    try:
        imgs = Runtime(st).images
        for name in images:
            imgs.import_path(runtime.images.get(name).path, name)
        (conf / "token").write_text(ADMIN + "\n")
        tokens = conf / "tokens"
        tokens.write_text(f"# owner:token\nalice:{ALICE}\nbob:{BOB}\n")
        os.chmod(tokens, 0o600)
        port = free_port()
        cfg = conf / "config.toml"
        cfg.write_text(f'tcp_listen = "127.0.0.1:{port}"\ntoken_file = "{conf / "token"}"\n'
                       f'tokens_file = "{tokens}"\n' + config)
        d = DaemonHandle(st, args=["--config", str(cfg)], env={"CRABD_INSPECTOR": "proc", **(env or {})})
        d.start()
        yield d, f"http://127.0.0.1:{port}"
    finally:
        if d is not None:
            d.shutdown()
        cleanup_state_dir(st)
        for p in conf.iterdir():
            p.unlink()
        conf.rmdir()


class As:
    """Requests over TCP as one token (None: no Authorization header)."""

    def __init__(self, base: str, token: str | None) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.c = httpx.Client(base_url=base, headers=headers, timeout=300)

    def __call__(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return self.c.request(method, path, **kw)

    def ok(self, method: str, path: str, **kw: Any) -> Any:
        r = self(method, path, **kw)
        assert r.status_code < 300, (method, path, r.status_code, r.text)
        return r.json()
