"""A real OCI registry for tests and benchmarks: Debian's `docker-registry`
(the CNCF distribution registry, installed by scripts/setup-host) started on
127.0.0.1:<free port> with its own config and storage directory, optionally
behind htpasswd basic auth (bcrypt entries made by apache2-utils' htpasswd).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from ..errors import FailedPrecondition

__all__ = ["LocalRegistry", "free_port"]

BINARY = "/usr/bin/docker-registry"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRegistry:
    """`with LocalRegistry(dir, user=..., password=...) as reg: reg.host` ("127.0.0.1:PORT")."""

    def __init__(self, root: Path, *, user: str | None = None, password: str | None = None,
                 port: int | None = None) -> None:
        self.root = Path(root)
        self.user, self.password = user, password
        self.port = port or free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = self.root / "storage"
        self.log = self.root / "registry.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def auth(self) -> str | None:
        return f"{self.user}:{self.password}" if self.user is not None else None

    def _config(self) -> Path:
        self.storage.mkdir(parents=True, exist_ok=True)
        lines = ["version: 0.1", "log:", "  level: warn", "storage:", "  filesystem:",
                 f"    rootdirectory: {self.storage}", "  delete:", "    enabled: true",
                 "http:", f"  addr: 127.0.0.1:{self.port}"]
        if self.user is not None:
            htpasswd = self.root / "htpasswd"
            r = subprocess.run(["htpasswd", "-Bbn", self.user, self.password or ""], capture_output=True,
                               timeout=30)
            if r.returncode != 0:
                raise FailedPrecondition(f"htpasswd failed: {r.stderr.decode(errors='replace')}",
                                         fix="apt-get install apache2-utils (scripts/setup-host)")
            htpasswd.write_bytes(r.stdout)
            lines += ["auth:", "  htpasswd:", "    realm: crabd-test", f"    path: {htpasswd}"]
        cfg = self.root / "config.yml"
        cfg.write_text("\n".join(lines) + "\n")
        return cfg

    def start(self) -> "LocalRegistry":
        if shutil.which(BINARY) is None:
            raise FailedPrecondition(f"{BINARY} is missing", fix="run scripts/setup-host (docker-registry)")
        cfg = self._config()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([BINARY, "serve", str(cfg)], stdout=log, stderr=log,
                                         start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise FailedPrecondition(f"docker-registry exited: {self.log.read_text()[-1500:]}")
            try:
                r = httpx.get(f"http://{self.host}/v2/", timeout=1)
                if r.status_code in (200, 401):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise FailedPrecondition(f"docker-registry did not answer on {self.host} in 20 s: "
                                 f"{self.log.read_text()[-1500:]}")

    def kill(self) -> None:
        """SIGKILL the registry (a registry that vanishes mid-transfer)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (to tamper with them in a test)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def __enter__(self) -> "LocalRegistry":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
