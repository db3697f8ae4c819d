"""Shared by every test: the import path, and the `needs` marker.

`@pytest.mark.needs("runc", "criu", ...)` (or a file's `pytestmark`) says
which host features a test needs: one of `FEATURES` below. Once the run's
tests are selected (`-m`, `-k`, paths), the host is checked for each feature
that a selected test needs, once per feature, and a missing one stops the
run before any test starts, naming the feature, the tests that need it and
the fix. Never a silent skip: a host that lacks a feature must not pass as
green. The checks are cheap probes (a binary, a kernel file system, an
importable module, a cached image); the tests' own fixtures fail with the
doctor's longer message when a probe passed but the feature does not work.
Unit tests need nothing; every integration test says what it needs
(tests/unit/test_needs_markers.py checks that).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("COLUMNS", "120")

TEST_STATE = Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test"))
SETUP = "run scripts/setup-host as root (it is idempotent)"


def _fs(name: str) -> bool:
    """A kernel file system that is registered, or a module that can be loaded."""
    try:
        if any(line.split()[-1] == name for line in Path("/proc/filesystems").read_text().splitlines() if line.strip()):
            return True
    except OSError:
        return False
    return Path(f"/lib/modules/{os.uname().release}/kernel/fs/{name}").exists()


def _image(name: str, builder: str) -> bool:
    """A test image is cached, or the tool its fixture builds it with is there."""
    return (TEST_STATE / "images" / name).exists() or shutil.which(builder) is not None


def _criu() -> bool:
    from crabd.doctor import OK, check_criu
    return check_criu(TEST_STATE).status == OK


# feature -> (probe, what it means when missing, fix)
FEATURES: dict[str, tuple[Callable[[], bool], str, str]] = {
    "root": (lambda: os.geteuid() == 0, "not running as root",
             "run the tests as root (`make test`)"),
    "runc": (lambda: shutil.which("runc") is not None, "runc not found", SETUP),
    "criu": (_criu, "CRIU missing or `criu check` fails (see `crabd doctor`)", SETUP),
    "bpf": (lambda: importlib.util.find_spec("bcc") is not None
            and Path(f"/lib/modules/{os.uname().release}/build").exists()
            and Path("/sys/kernel/tracing/events/syscalls").is_dir(),
            "bcc, the kernel headers or tracefs' syscall tracepoints missing", SETUP),
    "btrfs": (lambda: _fs("btrfs") and shutil.which("mkfs.btrfs") is not None,
              "no btrfs in the kernel, or mkfs.btrfs missing", SETUP),
    "overlay": (lambda: _fs("overlay"), "no overlayfs in the kernel", "modprobe overlay; " + SETUP),
    "docker": (lambda: shutil.which("docker") is not None and shutil.which("dockerd") is not None,
               "docker / dockerd not found", SETUP + " (installs docker.io)"),
    "netns": (lambda: shutil.which("ip") is not None, "`ip` (iproute2) not found", SETUP),
    "systemd": (lambda: shutil.which("systemd-analyze") is not None and shutil.which("systemd-tmpfiles") is not None,
                "systemd-analyze / systemd-tmpfiles not found", "apt-get install systemd"),
    "busybox": (lambda: _image("busybox", "busybox") and Path("/bin/busybox").exists(),
                "the busybox test image is not cached and /bin/busybox is missing", SETUP + " (installs busybox-static)"),
    "browser": (lambda: shutil.which("chromium") is not None and importlib.util.find_spec("playwright") is not None,
                "Debian's chromium or the playwright package is missing", SETUP + " (installs chromium)"),
    "registry": (lambda: Path("/usr/bin/docker-registry").exists() and shutil.which("htpasswd") is not None,
                 "Debian's docker-registry or apache2-utils' htpasswd is missing", SETUP + " (installs docker-registry)"),
    "debian-py": (lambda: _image("debian-py", "debootstrap"),
                  f"the debian-py test image is not in {TEST_STATE}/images and debootstrap is missing", SETUP),
}


def marker_name(feature: str) -> str:
    """The plain marker each `needs` feature also sets, for `-m` ("debian-py" -> debian_py)."""
    return feature.replace("-", "_")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"needs(*features): the host features a test needs, checked before the run: {', '.join(FEATURES)}")
    for f in FEATURES:
        config.addinivalue_line("markers", f"{marker_name(f)}: set by needs({f!r}); select with -m '{marker_name(f)}' "
                                           f"or leave out with -m 'not {marker_name(f)}'")


def needed(item: pytest.Item) -> set[str]:
    return {f for m in item.iter_markers("needs") for f in m.args}


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m "not docker"` sees the feature markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for f in needed(item):
            item.add_marker(marker_name(f))


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_finish(session: pytest.Session) -> None:
    items = session.items
    by_feature: dict[str, list[str]] = {}
    for item in items:
        for f in needed(item):
            by_feature.setdefault(f, []).append(item.nodeid)
    unknown = sorted(set(by_feature) - set(FEATURES))
    if unknown:
        raise pytest.UsageError(f"unknown host feature(s) {', '.join(unknown)} in a needs marker "
                                f"(of {by_feature[unknown[0]][0]}); known: {', '.join(FEATURES)}")
    missing = []
    for f in sorted(by_feature):
        probe, what, fix = FEATURES[f]
        if not probe():
            tests = by_feature[f]
            missing.append(f"host feature {f!r} is missing: {what}; needed by {len(tests)} selected test(s), "
                           f"e.g. {tests[0]}. Fix: {fix}")
    if missing:
        raise pytest.UsageError("\n".join(missing) + "\nOr leave those tests out of this run on purpose: "
                                "-m 'not FEATURE' (docs/testing.md).")
