"""Images as snapshots: an image's root file system copied once into a
committed deltafs snapshot that every sandbox of the image starts from.

Part of `crabd.daemon`; a collaborator of the daemon. The image itself (a
directory under the runtime's image store: `crabd/images.py`) is copied into
a new active snapshot, which is committed as `img-<image>` (`names.py`). The
copy is an external command and goes through the runtime's `Runner`, the one
seam where crabd runs commands.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import deltafs
from deltafs import mount_all, unmount

from ..errors import FailedPrecondition
from .names import IMPORT_MOUNT, image_snapshot, new_import_key

__all__ = ["ImageSnapshots"]


class ImageSnapshots:
    def __init__(self, fs: Any, runtime: Any, state_dir: Path) -> None:
        self.fs = fs                # the deltafs snapshotter
        self.runtime = runtime      # crabd.runtime.Runtime: its images and its runner
        self.state_dir = state_dir  # where the temporary mount point goes
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def snapshot(self, image: str) -> str:
        """The committed deltafs snapshot holding image `image` (made once)."""
        name = image_snapshot(image)
        with self._guard:
            lock = self._locks.setdefault(image, threading.Lock())
        with lock:
            try:
                self.fs.stat(name)
                return name
            except deltafs.NotFound:
                pass
            img = self.runtime.images.get(image)
            key = new_import_key(image)
            mounts = self.fs.prepare(key)
            tmp = tempfile.mkdtemp(prefix=IMPORT_MOUNT, dir=self.state_dir)
            try:
                mount_all(mounts, tmp)
                try:
                    r = self.runtime.runner.run(["cp", "-a", "--reflink=auto", f"{img.path}/.", tmp],
                                                timeout=3600, check=False, context=f"importing image {image}")
                    if r.returncode != 0:
                        err = r.stderr.decode(errors="replace").strip()[-300:]
                        raise FailedPrecondition(f"copying image {image} into a snapshot failed: {err}",
                                                 fix="check free space in the state directory")
                finally:
                    unmount(tmp)
                self.fs.commit(name, key)
            except BaseException:
                try:
                    self.fs.remove(key)
                except Exception:
                    pass
                raise
            finally:
                os.rmdir(tmp)
            return name
