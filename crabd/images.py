"""Images: read-only root file systems that sandboxes start from.

An image is a directory tree stored under `<state>/images/<name>/rootfs` with
its manifest `image.json` (source, size, default env and working dir). It is
built in a temporary directory beside its final place and renamed into place
only when complete, so a crash mid-import leaves a `.tmp-*` directory that
the next import or `gc` removes, never a half image under a real name.

crabd never writes into an image after import: sandboxes see it only as the
lowest, read-only layer of their root. Image directories are mode 0555 as a
guard against tools run by hand; root bypasses modes, so the real guarantee
is that no crabd code path opens an image for writing.

Sources: a directory, a tarball (any compression tar detects), a Docker
engine image (`docker://NAME[:TAG]`, exported through the Docker SDK), or a
debootstrap build of Debian.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .errors import AlreadyExists, CommandFailed, FailedPrecondition, InvalidArgument, NotFound
from .runner import Runner, SubprocessRunner

__all__ = ["Image", "ImageStore", "validate_name", "NAME_PATTERN", "DEBIAN_PYTHON_PACKAGES"]

#: Image and sandbox names (also the API schema's pattern for them).
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_NAME = re.compile(NAME_PATTERN)

# What `crabd image build debian` adds to minbase for a Python-capable image.
DEBIAN_PYTHON_PACKAGES = ("python3", "python3-venv", "python3-pip", "git", "curl", "ca-certificates")


def validate_name(name: str, what: str = "image") -> str:
    """Names become directory names: keep them boring. Pure."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(
            f"invalid {what} name {name!r}",
            fix="use 1-63 characters of a-z, 0-9, '.', '_', '-', starting with a letter or digit")
    return name


@dataclass
class Image:
    name: str
    source: str
    created_at: float
    size_bytes: int
    files: int
    env: list[str] = field(default_factory=list)
    workdir: str = "/"
    path: str = ""  # the rootfs directory; filled when loaded

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class ImageStore:
    """Images under `<state_dir>/images`.

    `users` tells which sandboxes use an image (by name) so that removing an
    image in use is refused; the runtime supplies it.
    """

    def __init__(self, state_dir: Path | str, *, runner: Runner | None = None,
                 users: Callable[[str], list[str]] | None = None) -> None:
        self.root = Path(state_dir) / "images"
        self.runner = runner or SubprocessRunner()
        self.users = users or (lambda name: [])

    # --- queries -------------------------------------------------------------
    def list(self) -> list[Image]:
        if not self.root.is_dir():
            return []
        out = []
        for d in sorted(self.root.iterdir()):
            if d.name.startswith(".") or not (d / "image.json").is_file():
                continue
            out.append(self._load(d))
        return out

    def get(self, name: str) -> Image:
        validate_name(name)
        d = self.root / name
        if not (d / "image.json").is_file():
            known = ", ".join(i.name for i in self.list()) or "none"
            raise NotFound(f"no image named {name!r} (images: {known})",
                           fix="crabd image import PATH|TARBALL|docker://NAME --name N, or crabd image build debian --name N")
        return self._load(d)

    def exists(self, name: str) -> bool:
        return (self.root / validate_name(name) / "image.json").is_file()

    def _load(self, d: Path) -> Image:
        data = json.loads((d / "image.json").read_text())
        data["path"] = str(d / "rootfs")
        return Image(**data)

    # --- imports ---------------------------------------------------------------
    def import_path(self, src: str, name: str, *, progress: Callable[[str], None] | None = None) -> Image:
        """Import a directory, a tarball, or `docker://NAME[:TAG]`."""
        if src.startswith("docker://"):
            return self.import_docker(src[len("docker://"):], name, progress=progress)
        p = Path(src)
        if p.is_dir():
            return self._build(name, f"dir:{p.resolve()}", lambda tmp: self._copy_dir(p, tmp), progress)
        if p.is_file():
            return self._build(name, f"tar:{p.resolve()}", lambda tmp: self._untar_file(p, tmp), progress)
        raise NotFound(f"image source {src!r} does not exist",
                       fix="give a directory, a tarball, or docker://NAME[:TAG]")

    def import_docker(self, ref: str, name: str, *, progress: Callable[[str], None] | None = None) -> Image:
        """Export a Docker engine image's file system through the Docker SDK."""
        try:
            import docker  # imported here: only this path needs a Docker engine
            import docker.errors
        except ImportError as e:  # pragma: no cover - pinned dependency
            raise FailedPrecondition("the docker Python SDK is not installed", fix="scripts/setup-host") from e
        try:
            client = docker.from_env(timeout=60)
            client.ping()
        except Exception as e:  # docker raises several unrelated types here
            raise FailedPrecondition(f"no Docker engine answers ({e})",
                                     fix="start one: dockerd --iptables=false --bridge=none (scripts/setup-host does)") from e
        try:
            img = client.images.get(ref)
        except docker.errors.ImageNotFound as e:
            raise NotFound(f"Docker image {ref!r} is not in the local engine",
                           fix=f"docker pull {ref} or docker import/load it first") from e
        config = img.attrs.get("Config") or {}
        env = list(config.get("Env") or [])
        workdir = config.get("WorkingDir") or "/"

        def export(tmp: Path) -> None:
            # The command is never run: a container is only created to export.
            cid = client.api.create_container(img.id, command=["/crabd-export-only"])["Id"]
            try:
                tar = subprocess.Popen(_TAR_X + ["-C", str(tmp), "-f", "-"], stdin=subprocess.PIPE,
                                       stderr=subprocess.PIPE)
                assert tar.stdin is not None
                try:
                    for chunk in client.api.export(cid):
                        tar.stdin.write(chunk)
                finally:
                    tar.stdin.close()
                err = tar.stderr.read().decode(errors="replace") if tar.stderr else ""
                if tar.wait(timeout=600) != 0:
                    raise CommandFailed(_TAR_X, tar.returncode, err, context=f"unpack of docker export {ref}")
            finally:
                client.api.remove_container(cid, force=True)
            # Docker adds these as mount points; they are not image content.
            for f in (".dockerenv",):
                (tmp / f).unlink(missing_ok=True)

        return self._build(name, f"docker:{ref}@{img.id}", export, progress, env=env, workdir=workdir)

    def build_debian(self, name: str, *, suite: str = "bookworm", packages: Iterable[str] = DEBIAN_PYTHON_PACKAGES,
                     mirror: str = "http://deb.debian.org/debian",
                     progress: Callable[[str], None] | None = None) -> Image:
        """debootstrap a minbase Debian plus `packages` (~45 s, ~420 MB)."""
        pkgs = [p for p in packages if p]
        for p in pkgs:
            if not re.match(r"^[a-z0-9][a-z0-9+.-]+$", p):
                raise InvalidArgument(f"invalid Debian package name {p!r}")

        def boot(tmp: Path) -> None:
            argv = ["debootstrap", "--variant=minbase"]
            if pkgs:
                argv.append("--include=" + ",".join(pkgs))
            argv += [suite, str(tmp), mirror]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            lines: list[str] = []
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                lines.append(line)
                if progress and line.startswith("I: "):
                    progress(line[3:])
            if proc.wait(timeout=1800) != 0:
                raise CommandFailed(argv, proc.returncode, "\n".join(lines[-20:]), context="debootstrap",
                                    fix=f"check access to {mirror} and free space under {self.root}")
            # Package caches are not image content; drop them to keep images small.
            for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for f in (tmp / d).glob("*"):
                    if f.is_file():
                        f.unlink()

        return self._build(name, f"debootstrap:{suite}+{','.join(pkgs)}", boot, progress,
                           env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])

    # --- removal -------------------------------------------------------------------
    def remove(self, name: str) -> None:
        img = self.get(name)
        users = self.users(name)
        if users:
            raise FailedPrecondition(f"image {name!r} is in use by sandbox(es) {', '.join(sorted(users))}",
                                     fix="remove those sandboxes first (crabd sandbox rm ID)")
        d = Path(img.path).parent
        # Rename first so the name is free at once and a crash mid-delete
        # leaves only a trash directory that gc() clears.
        trash = self.root / f".trash-{name}-{uuid.uuid4().hex[:8]}"
        os.rename(d, trash)
        _rmtree(trash)

    def gc(self) -> list[str]:
        """Remove leftovers of interrupted imports and removals."""
        gone = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                if d.name.startswith((".tmp-", ".trash-")):
                    _rmtree(d)
                    gone.append(d.name)
        return gone

    # --- internals ---------------------------------------------------------------
    def _build(self, name: str, source: str, fill: Callable[[Path], None],
               progress: Callable[[str], None] | None, *, env: list[str] | None = None,
               workdir: str = "/") -> Image:
        validate_name(name)
        if self.exists(name):
            raise AlreadyExists(f"image {name!r} already exists", fix=f"crabd image rm {name}, or pick another --name")
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        rootfs = tmp / "rootfs"
        rootfs.mkdir(parents=True)
        try:
            fill(rootfs)
            if not any(rootfs.iterdir()):
                raise InvalidArgument(f"image source {source} is empty")
            size, files = _tree_size(rootfs)
            img = Image(name=name, source=source, created_at=time.time(), size_bytes=size, files=files,
                        env=env or [], workdir=workdir)
            manifest = asdict(img)
            manifest.pop("path")
            (tmp / "image.json").write_text(json.dumps(manifest, indent=2))
            os.chmod(tmp, 0o555)
            if self.exists(name):
                raise AlreadyExists(f"image {name!r} was created concurrently")
            os.rename(tmp, self.root / name)
        except BaseException:
            _rmtree(tmp)
            raise
        if progress:
            progress(f"image {name}: {files} files, {size / 1e6:.1f} MB")
        return self.get(name)

    def _copy_dir(self, src: Path, dst: Path) -> None:
        # cp -a keeps symlinks as symlinks (never follows them), hard links,
        # device nodes, fifos, owners, modes, times and xattrs.
        self.runner.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dst)], timeout=3600,
                        context=f"copy of {src}")

    def _untar_file(self, src: Path, dst: Path) -> None:
        self.runner.run(_TAR_X + ["-C", str(dst), "-f", str(src)], timeout=3600, context=f"unpack of {src}")


_TAR_X = ["tar", "-x", "-p", "--numeric-owner", "--same-owner", "--xattrs", "--xattrs-include=*"]


def _tree_size(root: Path) -> tuple[int, int]:
    """(allocated bytes, entries) without following symlinks."""
    size = files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except FileNotFoundError:
                continue
            size += st.st_blocks * 512
            files += 1
    return size, files


def _rmtree(path: Path) -> None:
    if not path.exists():
        return
    # Image dirs are 0555; make them writable so non-root cleanup works too.
    try:
        os.chmod(path, 0o755)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)
