"""Host compatibility: CRIU 4.1.x on Linux >= 6.16.

Linux 6.16 made getsockopt(SO_PASSCRED/SO_PASSSEC) fail on non-unix sockets,
and CRIU before 4.2 fails every dump of a process holding a TCP or UDP
socket ("Can't get 1:16 opt: Operation not supported"). Where that
combination is found, `host_criu` builds a tiny LD_PRELOAD shim
(criu_sockopt_shim.c, next to this file) and a wrapper script that runs
CRIU with it; runc is pointed at the wrapper with `runc --criu`. With
CRIU >= 4.2, or an older kernel, CRIU is used as it is.

The same shim reads a dumped task's rlimits from /proc/PID/limits where
the host refuses CRIU's prlimit64 of them: a task of another user, on a
host without CAP_SYS_RESOURCE (see the shim's source). So the wrapper is
also used wherever crabd runs without that capability.

CRIU saves a tmpfs's contents (a sandbox's /dev, /dev/shm and any tmpfs
it has) with `tar` and restores them with `tar`, without `--xattrs`: every
extended attribute of a file on a tmpfs (user.*, trusted.*, file
capabilities, ACLs) was lost at restore (found by crabd's ground-truth
oracle). So the wrapper always puts a `tar` first on CRIU's PATH that adds
`--xattrs --xattrs-include=*` to CRIU's create and extract, and the wrapper
is used on every host.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path

from .errors import CriuUnavailable
from .runc import CommandRunner, SubprocessCommandRunner, check_criu

__all__ = ["host_criu", "needs_sockopt_shim", "tar_shim_text", "has_cap_sys_resource", "CAP_SYS_RESOURCE"]

CAP_SYS_RESOURCE = 24

_SHIM_SRC = Path(__file__).with_name("criu_sockopt_shim.c")
_lock = threading.Lock()
_build_lock = threading.Lock()
_cache: dict[tuple[str, str], str] = {}


def needs_sockopt_shim(criu_version: tuple[int, ...], kernel_release: str) -> bool:
    """Pure: does this CRIU need the shim on this kernel?"""
    m = re.match(r"(\d+)\.(\d+)", kernel_release)
    kernel = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    return kernel >= (6, 16) and tuple(criu_version[:2]) < (4, 2)


def has_cap_sys_resource(status_text: str | None = None) -> bool:
    """Has this process CAP_SYS_RESOURCE in its effective set? (`status_text`:
    a /proc/PID/status to read instead of our own.)"""
    if status_text is None:
        with open("/proc/self/status") as f:
            status_text = f.read()
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text, re.M)
    return bool(m) and bool(int(m.group(1), 16) >> CAP_SYS_RESOURCE & 1)  # type: ignore[union-attr]


def host_criu(cache_dir: str | os.PathLike[str], criu: str = "criu",
              runner: CommandRunner | None = None) -> str:
    """The CRIU command runc should use on this host: a wrapper (built once
    into `cache_dir`) that puts the xattr-keeping `tar` on CRIU's PATH and,
    where needed, preloads the socket-option shim."""
    key = (str(cache_dir), criu)
    with _lock:
        if key in _cache:
            return _cache[key]
    # One build at a time: two threads building into the same cache dir
    # would race on its temporary file (seen as a failed first checkpoint).
    with _build_lock:
        with _lock:
            if key in _cache:
                return _cache[key]
        info = check_criu(runner or SubprocessCommandRunner(), criu)
        preload = needs_sockopt_shim(info.version, platform.release()) or not has_cap_sys_resource()
        result = _build_wrapper(Path(cache_dir), criu, preload)
    with _lock:
        _cache[key] = result
    return result


def _write_script(path: Path, text: str) -> None:
    """Write an executable script unless it already has `text` (atomic)."""
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)


def tar_shim_text(real_tar: str) -> str:
    """Pure: the `tar` CRIU finds first on its PATH (see the module doc)."""
    return ("#!/bin/sh\n# deltacr: CRIU's tmpfs dump and restore, with extended attributes (see deltacr/compat.py)\n"
            "case \"$1\" in\n"
            f"--create|--extract) exec \"{real_tar}\" --xattrs '--xattrs-include=*' \"$@\" ;;\n"
            "esac\n"
            f"exec \"{real_tar}\" \"$@\"\n")


def _build_wrapper(d: Path, criu: str, preload: bool) -> str:
    real = shutil.which(criu) or criu
    d.mkdir(parents=True, exist_ok=True)
    bindir = d / "bin"
    bindir.mkdir(exist_ok=True)
    real_tar = shutil.which("tar")
    if real_tar and Path(real_tar).parent != bindir:
        _write_script(bindir / "tar", tar_shim_text(real_tar))
    env = f'PATH="{bindir}:$PATH"'
    if not preload:
        _write_script(d / "criu", f'#!/bin/sh\n# deltacr: CRIU with tar keeping xattrs (see deltacr/compat.py)\n'
                                  f'{env} exec "{real}" "$@"\n')
        return str(d / "criu")
    so = d / "criu_sockopt_shim.so"
    wrapper = d / "criu"
    try:
        src = _SHIM_SRC.read_bytes()
    except FileNotFoundError:
        raise CriuUnavailable(f"CRIU < 4.2 on Linux >= 6.16 needs deltacr's socket-option shim, and its source "
                              f"{_SHIM_SRC} is not installed", missing=[str(_SHIM_SRC)],
                              fix="install crabd with deltacr's package data (*.c), or CRIU 4.2 or newer") from None
    stamp = d / "criu_sockopt_shim.src"
    if not so.exists() or not stamp.exists() or stamp.read_bytes() != src:
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise CriuUnavailable("CRIU < 4.2 on Linux >= 6.16 needs deltacr's socket-option shim, "
                                  "and no C compiler is installed to build it",
                                  missing=["cc (to build the CRIU socket-option shim)", "or CRIU >= 4.2"],
                                  fix="apt-get install gcc libc6-dev, or install CRIU 4.2 or newer")
        tmp = so.with_suffix(".so.tmp")
        p = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(_SHIM_SRC), "-ldl"],
                           capture_output=True, timeout=120)
        if p.returncode != 0:
            raise CriuUnavailable(f"building the CRIU socket-option shim failed: {p.stderr.decode(errors='replace')[-400:]}",
                                  missing=["a working C compiler"], fix="apt-get install gcc libc6-dev")
        os.replace(tmp, so)
        stamp.write_bytes(src)
    _write_script(wrapper, f'#!/bin/sh\n# deltacr: CRIU with the SO_PASSCRED and rlimit shim, and tar keeping '
                           f'xattrs (see deltacr/compat.py)\n{env} LD_PRELOAD="{so}" exec "{real}" "$@"\n')
    return str(wrapper)
