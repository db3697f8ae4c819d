"""Shared fixtures for integration tests: root, real runc, real images.

Integration tests never skip on this host: a missing capability fails the
test with the doctor's message, so a broken host cannot pass as green.

Images are cached in a test state directory (default /var/lib/crabd-test,
or $CRABD_TEST_STATE_DIR) across runs: the Debian image takes ~45 s to
debootstrap, once per host. Sandboxes made by a test are destroyed by it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

TEST_STATE = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
DEBIAN_IMAGE = "debian-py"
BUSYBOX_IMAGE = "busybox"


def pytest_collection_modifyitems(items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def _require_root():
    if os.geteuid() != 0:
        pytest.fail("integration tests need root (they run runc, mount file systems, load BPF): "
                    "run `make test` as root", pytrace=False)


def doctor_hint(name: str) -> str:
    from crabd.doctor import run_checks
    for c in run_checks(TEST_STATE):
        if c.name == name and c.status != "ok":
            return f"crabd doctor: {c.name}: {c.status}: {c.detail} (fix: {c.fix})"
    return ""


@pytest.fixture(scope="session")
def runtime():
    from crabd.runtime import Runtime
    TEST_STATE.mkdir(parents=True, exist_ok=True)
    if shutil.which("runc") is None:
        pytest.fail(doctor_hint("runc") or "runc missing: run scripts/setup-host", pytrace=False)
    return Runtime(TEST_STATE)


def _busybox_rootfs(dst: Path) -> Path:
    """A minimal image: static busybox and its applet links, nothing else."""
    from crabd.errors import FailedPrecondition
    from crabd.testing import busybox_rootfs
    try:
        return busybox_rootfs(dst)
    except FailedPrecondition as e:
        pytest.fail(f"{e.message} (fix: {e.fix})", pytrace=False)


@pytest.fixture(scope="session")
def make_busybox_rootfs():
    """make_busybox_rootfs(dir) -> dir: fills dir with a busybox-only root."""
    return _busybox_rootfs


@pytest.fixture(scope="session")
def busybox_image(runtime, tmp_path_factory):
    if not runtime.images.exists(BUSYBOX_IMAGE):
        src = _busybox_rootfs(tmp_path_factory.mktemp("bb") / "rootfs")
        runtime.images.import_path(str(src), BUSYBOX_IMAGE)
    return BUSYBOX_IMAGE


@pytest.fixture(scope="session")
def debian_image(runtime):
    """Debian 12 minbase + python3, venv, pip, git, curl (built once per host)."""
    if not runtime.images.exists(DEBIAN_IMAGE):
        runtime.images.gc()
        runtime.images.build_debian(DEBIAN_IMAGE)
    return DEBIAN_IMAGE


@pytest.fixture
def sandbox_factory(runtime):
    made = []

    def make(image, **kw):
        sb = runtime.create(image, **kw)
        made.append(sb.id)
        return sb

    yield make
    for sid in made:
        try:
            runtime.destroy(sid)
        except Exception:
            pass



def _daemons(runtime):
    """A factory of started daemons (see start_daemon) and the list of them,
    for the caller to stop and clean up."""
    import tempfile

    from crabd.runtime import Runtime
    from crabd.testing import DaemonHandle

    made: list = []

    def start(args=None, env=None, images=(BUSYBOX_IMAGE,), state=None):
        st = Path(state) if state else Path(tempfile.mkdtemp(prefix="crabd-test-", dir="/var/tmp"))
        imgs = Runtime(st).images
        for name in images:
            if name == DEBIAN_IMAGE and not runtime.images.exists(DEBIAN_IMAGE):
                runtime.images.build_debian(DEBIAN_IMAGE)
            if not imgs.exists(name):
                imgs.import_path(runtime.images.get(name).path, name)
        d = DaemonHandle(st, args=args, env=env)
        d.start()
        made.append(d)
        return d

    return start, made


def _stop_all(made) -> None:
    from crabd.testing import cleanup_state_dir

    for d in made:
        d.shutdown()
        cleanup_state_dir(d.state)


@pytest.fixture
def start_daemon(runtime, busybox_image):
    """start_daemon(args=[...], env={...}, images=("busybox",), state=None) -> a
    started DaemonHandle on its own state dir (under /var/tmp) with the named
    test images imported; stopped and cleaned up after the test."""
    start, made = _daemons(runtime)
    yield start
    _stop_all(made)


@pytest.fixture(scope="module")
def module_daemon(runtime, busybox_image):
    """start_daemon for daemons a whole test module shares (each test makes
    its own sandboxes): for modules of many short scenarios, where a daemon
    and an image import per test would be most of the time. Stopped after
    the module."""
    start, made = _daemons(runtime)
    yield start
    _stop_all(made)
