#!/usr/bin/env python3
"""Inputs of the agent traces: PyPI files and images, fetched once, then local.

Sandboxes have no network. A trace that works on a real package names the
files it needs in its `inputs` field (README.md "Traces"); this module fetches
them once from PyPI into a cache on the host and copies them into a sandbox
at /inputs/NAME before the trace's files and setup, where the trace installs
them with `pip install --no-index --find-links /inputs`.

    python -m bench.inputs [--images]     # fetch every pinned input (and build the images)

The cache is /var/cache/crabd-bench (CRABD_BENCH_CACHE overrides it):
    pypi/NAME              sdists and wheels, exact pins below, fetched with pip download
    local/NAME             inputs made on this host (`crabd bench swebench` repository archives)
    images/NAME/rootfs     images the traces use that are not cached elsewhere
                           (debian-build = debian-py + gcc, make, sqlite3; built with
                           debootstrap like `crabd image build debian`, ~2 min once)
"""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from crabd.images import DEBIAN_PYTHON_PACKAGES, ImageStore

ROOT = Path(__file__).resolve().parent.parent

CACHE = Path(os.environ.get("CRABD_BENCH_CACHE", "/var/cache/crabd-bench"))
SANDBOX_DIR = "/inputs"
CHUNK = 3 * 1024 * 1024  # bytes per exec: 4 MiB of base64, well under the API's 8 MiB body limit

# Every input a shipped trace may name: file name -> pip requirement that yields it.
# Exact pins keep the traces' state digests stable.
PINNED: dict[str, tuple[str, str]] = {
    # sdists (source trees the code-repair traces work on)
    "more-itertools-10.2.0.tar.gz": ("more-itertools==10.2.0", "sdist"),
    "click-8.1.7.tar.gz": ("click==8.1.7", "sdist"),
    "six-1.16.0.tar.gz": ("six==1.16.0", "sdist"),
    # the wheelhouse: pytest and its dependencies (pure Python)
    "pytest-8.0.2-py3-none-any.whl": ("pytest==8.0.2", "wheel"),
    "pluggy-1.4.0-py3-none-any.whl": ("pluggy==1.4.0", "wheel"),
    "iniconfig-2.0.0-py3-none-any.whl": ("iniconfig==2.0.0", "wheel"),
    "packaging-23.2-py3-none-any.whl": ("packaging==23.2", "wheel"),
}
WHEELHOUSE = [n for n, (_, kind) in PINNED.items() if kind == "wheel"]

# Images the traces use: name -> Debian packages on top of minbase.
DEBIAN_BUILD_PACKAGES = (*DEBIAN_PYTHON_PACKAGES, "gcc", "libc6-dev", "make", "sqlite3", "patch")
IMAGES: dict[str, tuple[str, ...]] = {
    "debian-py": DEBIAN_PYTHON_PACKAGES,
    "debian-build": DEBIAN_BUILD_PACKAGES,
}
# Where already-built images may be found (the test suite's and the demo's caches).
IMAGE_SOURCES = [Path(os.environ.get("CRABD_TEST_STATE_DIR", "/var/lib/crabd-test")) / "images", CACHE / "images",
                 Path("/var/lib/crabd-demo/images"),
                 Path("/var/lib/crabd/images")]


def path(name: str) -> Path:
    return CACHE / "pypi" / name


def local_path(name: str) -> Path:
    """Where inputs made on this host live (e.g. `crabd bench swebench` repository archives)."""
    return CACHE / "local" / name


def fetch(names: Iterable[str]) -> list[Path]:
    """Make sure every named input is in the cache (one `pip download` per missing file)."""
    out = []
    for name in names:
        if name not in PINNED and local_path(name).is_file():
            out.append(local_path(name))
            continue
        if name not in PINNED:
            raise SystemExit(f"input {name!r} is neither pinned in bench/inputs.py PINNED (known: "
                             f"{', '.join(sorted(PINNED))}) nor made on this host ({local_path(name)})")
        p = path(name)
        if not p.is_file():
            req, kind = PINNED[name]
            p.parent.mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(p.parent), req,
                    "--no-binary=:all:" if kind == "sdist" else "--only-binary=:all:"]
            r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if r.returncode != 0 or not p.is_file():
                raise SystemExit(f"fetching {req} ({kind}) from PyPI failed: {r.stderr.strip()[-800:]}\n"
                                 f"fix: check access to pypi.org, or put {name} into {p.parent} by hand")
        out.append(p)
    return out


def stage(names: Iterable[str], run: Callable[[list[str], str], dict]) -> None:
    """Copy inputs into a sandbox: `run(argv, stdin)` executes in it and returns an exec result.

    The bytes go base64-encoded through the exec's stdin, in pieces that fit
    the API's request limit (8 MiB), so this works through the daemon API and
    a bare runtime alike.
    """
    for p in fetch(names):
        dst = f"{SANDBOX_DIR}/{p.name}"
        with open(p, "rb") as f:
            first = True
            while True:
                piece = f.read(CHUNK)
                if not piece and not first:
                    break
                redirect = ">" if first else ">>"
                r = run(["sh", "-c", f"mkdir -p {SANDBOX_DIR} && base64 -d {redirect} {dst}"],
                        base64.b64encode(piece).decode())
                if r["exit_code"] != 0:
                    raise RuntimeError(f"copying input {p.name} into the sandbox: {r.get('stderr', '')}")
                first = False


def prelude(trace: Any, run: Callable[[list[str] | str, str | None], dict]) -> None:
    """What a task gives a sandbox before turn 1 (and all a chat-only restart has):
    the trace's inputs, then its files, then its setup. `run(cmd, stdin)` executes in
    the sandbox (argv list or shell string) and returns an exec result dict."""
    stage(trace.inputs, lambda argv, data: run(argv, data))
    for p, content in trace.files.items():
        d = p.rsplit("/", 1)[0] or "/"
        r = run(["sh", "-c", f"mkdir -p '{d}' && cat > '{p}'"], content)
        if r["exit_code"] != 0:
            raise RuntimeError(f"{trace.name}: writing {p}: {r.get('stderr', '')}")
    for cmd in trace.setup:
        r = run(cmd, None)
        if r["exit_code"] != 0:
            raise RuntimeError(f"{trace.name}: setup {cmd!r} exited {r['exit_code']}: {r.get('stderr', '')[-500:]}")


def image_rootfs(name: str, progress: Callable[[str], None] | None = None) -> Path:
    """The rootfs directory of a trace image: found in a known cache, else built into ours."""
    for d in IMAGE_SOURCES:
        if (d / name / "rootfs").is_dir() and (d / name / "image.json").is_file():
            return d / name / "rootfs"
    if name not in IMAGES:
        raise SystemExit(f"image {name!r} not found under {', '.join(map(str, IMAGE_SOURCES))}; "
                         f"bench/inputs.py builds only {', '.join(IMAGES)}")
    print(f"building image {name} with debootstrap into {CACHE / 'images'} (once, a few minutes) ...",
          file=sys.stderr, flush=True)
    img = ImageStore(CACHE).build_debian(name, packages=IMAGES[name], progress=progress)
    return Path(img.path)


def parser() -> argparse.ArgumentParser:
    """The benchmark's options (also `crabd bench NAME --help`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", action="store_true", help="also build the trace images that are not cached")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    for p in fetch(PINNED):
        print(f"{p.stat().st_size:>9}  {p}")
    if a.images:
        for name in IMAGES:
            print(f"{name}: {image_rootfs(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
