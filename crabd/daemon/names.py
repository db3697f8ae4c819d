"""Names of the daemon's deltafs snapshots and scratch directories: the one
place their prefixes are spelled.

Part of `crabd.daemon`. The snapshot store (deltafs) knows only names; the
daemon's store rows name the snapshots they use, and start-up reconciliation
(`startup.py`) recognises what a crash left behind by these prefixes:

* ``img-<image>``  committed: an image's root file system, made once, shared
  by every sandbox (and checkpoint 0) created from it; never removed with a
  sandbox.
* ``import-<image>-<hex>``  active: an image import in progress.
* ``root-<hex>``  active: a sandbox's writable root (its row's `fs_key`).
* ``standby-<hex>``  active: a hot standby's root (`standbys.py`).
* ``fullview-...``  active: left by an older crabd's capture mode `full`.
* ``img-rmt-<hex>``  committed: a layer a registry pull imported
  (`crabd.remote.transfer.IMPORTED_PREFIX`, spelled there).
* ``<sandbox>-<seq>``  committed: a checkpoint's snapshot, named after the
  checkpoint (its process image in the CRIU store has the same name).
"""

from __future__ import annotations

import secrets

__all__ = ["IMAGE", "IMPORT_MOUNT", "FULL_MOUNT", "image_snapshot", "is_image_snapshot", "new_import_key",
           "new_root_key", "new_standby_key", "is_standby_key", "is_sandbox_root", "checkpoint_id",
           "REMOTE_LAYER"]

IMAGE = "img-"
_IMPORT = "import-"
_ROOT = "root-"
_STANDBY = "standby-"
_FULLVIEW = "fullview-"
# crabd.remote.transfer.IMPORTED_PREFIX, repeated so that a start need not
# import the registry code to see there is nothing of it to clean up
# (tests/unit/crabd/test_lazy_imports.py checks they agree).
REMOTE_LAYER = "img-rmt-"
# Temporary mount points under the state directory (an image import, or an
# older crabd's full-mode copy) that a crash may leave mounted.
IMPORT_MOUNT = "crabd-import-"
FULL_MOUNT = "crabd-full-"


def image_snapshot(image: str) -> str:
    """The committed snapshot holding image `image`."""
    return f"{IMAGE}{image}"


def is_image_snapshot(name: str | None) -> bool:
    """An image's snapshot: shared by every sandbox of the image, never a
    checkpoint's own (so never removed with a checkpoint or sandbox)."""
    return name is not None and name.startswith(IMAGE)


def new_import_key(image: str) -> str:
    return f"{_IMPORT}{image}-{secrets.token_hex(4)}"


def new_root_key() -> str:
    return f"{_ROOT}{secrets.token_hex(6)}"


def new_standby_key() -> str:
    return f"{_STANDBY}{secrets.token_hex(6)}"


def is_standby_key(name: str) -> bool:
    return name.startswith(_STANDBY)


def is_sandbox_root(name: str) -> bool:
    """An active snapshot that some sandbox row names as its root when all
    went well (a sandbox root, an import, an older crabd's full-mode view)."""
    return name.startswith((_ROOT, _IMPORT, _FULLVIEW))


def checkpoint_id(sandbox_id: str, seq: int) -> str:
    """Checkpoint `seq` of a sandbox; also its snapshot's and process image's name."""
    return f"{sandbox_id}-{seq}"
