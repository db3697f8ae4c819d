"""deltafs: copy-on-write file-system snapshots for sandboxes.

A library usable without the crabd daemon (it never imports `crabd`). Mount
specs are data (`Mount`); `mount_all` performs them.
"""

from .mount import Mount, MountError, is_mountpoint, mount_all, unmount

__all__ = ["Mount", "MountError", "is_mountpoint", "mount_all", "unmount"]
