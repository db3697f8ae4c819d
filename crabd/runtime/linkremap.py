"""Open files whose name was unlinked while another hard link keeps them
(zdtm unlink_fstat03: `open(a); link(a, b); unlink(a)`), checkpointed with
the processes that hold them.

Part of `crabd.runtime`, beside `criu.py`. CRIU dumps such a file through
a hard link it makes next to the old name (`<dir>/link_remap.<id>`, its
--link-remap, deltacr's DumpOptions.link_remap) and the restore opens that
name and removes it. But crabd commits the sandbox's files before CRIU
dumps (deltacr.capture_consistent: freeze, FS commit, dump), and CRIU
removes its link again after a dump that leaves the tasks running, so the
checkpoint's files never held it and every restore would fail. So, while
the sandbox is frozen and before the files are committed, crabd makes a
hard link of its own next to each such file (`<dir>/.crabd-link-remap.<inode>`,
`link_open_unlinked`), which the FS commit keeps; it is removed from the
live sandbox right after the dump. Before a restore, `prepare_restore`
links it under the name CRIU's image asks for (deltacr.store.linked_remaps
reads it from the image), and `cleanup_restore` removes crabd's name
afterwards (CRIU removes its own). Only files on the sandbox's root mount
are handled; one elsewhere (a tmpfs) leaves link-remap off, and CRIU's
dump fails as before, the reason in the checkpoint.

A dump that fails or is refused after the FS commit leaves the links in
that commit: the caller drops it and commits the files again without them
(criu.py's `committed_links`, daemon/pipeline.py). Links crabd made in a
live sandbox outlive a crash of crabd between making and removing them, so
each set is first written to a journal (`<state>/link-remaps/<id>.json`,
`journal`); `recover` at the daemon's start removes what a journal names.

    remaps, missed = link_open_unlinked(pids)  # frozen, before the FS commit
    ... FS commit; dump with DumpOptions(link_remap=bool(remaps)) ...
    unlink_all(rootfs, remaps)                   # still frozen
    # restore: prepare_restore(rootfs, image_dir, remaps) ... cleanup_restore(...)
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from deltacr.store import linked_remaps
from deltafs.tree import open_dir, open_rel

__all__ = ["link_open_unlinked", "unlink_all", "prepare_restore", "cleanup_restore", "LINK_PREFIX", "journal",
           "recover"]

log = logging.getLogger("crabd.runtime.linkremap")

LINK_PREFIX = ".crabd-link-remap."
_DELETED = " (deleted)"


def _parent_fd(rootfs: Path, path: str) -> tuple[int, str]:
    """The directory of `path` (as the sandbox sees it) under `rootfs`,
    opened one component at a time without following a symlink (the
    sandbox's symlinks never lead crabd outside it), and the last name."""
    parent, _, name = path.strip("/").rpartition("/")
    root = open_dir(str(rootfs))
    try:
        return open_rel(root, os.fsencode(parent)), name
    finally:
        os.close(root)


def _unlink_inside(rootfs: Path, path: str) -> None:
    fd, name = _parent_fd(rootfs, path)
    try:
        os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _link_inside(rootfs: Path, src: str, dst: str) -> None:
    sfd, sname = _parent_fd(rootfs, src)
    try:
        dfd, dname = _parent_fd(rootfs, dst)
        try:
            os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _mnt_id(fd: int) -> int | None:
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("mnt_id:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _candidates(pids: list[int]) -> dict[tuple[int, int], tuple[int, str, str]]:
    """{(dev, ino): (pid, a /proc path that opens it, its old name)} of the
    regular files the tasks hold open (descriptors and mappings) whose name
    was unlinked but which still have a hard link (st_nlink > 0)."""
    out: dict[tuple[int, int], tuple[int, str, str]] = {}
    for pid in pids:
        for sub in ("fd", "map_files"):
            d = f"/proc/{pid}/{sub}"
            try:
                names = os.listdir(d)
            except OSError:
                continue
            for n in names:
                p = f"{d}/{n}"
                try:
                    target = os.readlink(p)
                    if not target.endswith(_DELETED) or not target.startswith("/"):
                        continue
                    st = os.stat(p)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 0:
                    out.setdefault((st.st_dev, st.st_ino), (pid, p, target[: -len(_DELETED)]))
    return out


def _link_one(pid: int, proc_path: str, link: str) -> str | None:
    """Hard-link the file `proc_path` opens as `link` (the sandbox's view),
    through the task's own root: linkat refuses two different mounts of a
    file system (EXDEV), and the task's fd is on the sandbox's root mount,
    not on the host's mount of its rootfs. The reason when it cannot."""
    fd = root = -1
    try:
        fd = os.open(proc_path, os.O_PATH)
        root = os.open(f"/proc/{pid}/root", os.O_PATH)
        if _mnt_id(fd) != _mnt_id(root):
            return "not on the sandbox's root mount"
        parent = os.open(os.path.dirname(link).lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY, dir_fd=root)
        try:
            _linkat_empty_path(fd, parent, os.path.basename(link))
        finally:
            os.close(parent)
        return None
    except FileExistsError:
        return None  # left by a crash: the name holds the inode number
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for x in (fd, root):
            if x >= 0:
                os.close(x)


_AT_EMPTY_PATH = 0x1000
_libc = ctypes.CDLL(None, use_errno=True)


def _linkat_empty_path(fd: int, dir_fd: int, name: str) -> None:
    """linkat(fd, "", dir_fd, name, AT_EMPTY_PATH), as CRIU links a file it
    holds open: os.link has no AT_EMPTY_PATH, and its /proc/self/fd/N form
    links the magic link itself (EXDEV) on this Python."""
    if _libc.linkat(fd, b"", dir_fd, os.fsencode(name), _AT_EMPTY_PATH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)


JOURNAL_DIR = "link-remaps"


def journal(state_dir: Path, name: str) -> Path:
    """Where the links crabd is about to make in `name`'s root are written
    first (a sandbox id, or a restore's container id)."""
    return state_dir / JOURNAL_DIR / f"{name}.json"


def _write_journal(path: Path, rootfs: Path, links: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump({"rootfs": str(rootfs), "links": links}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _drop_journal(path: Path | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def recover(state_dir: Path) -> int:
    """At the daemon's start: remove the links each journal names (crabd
    stopped between making and removing them; the sandbox may still be
    frozen), then the journal. Returns how many links went."""
    n = 0
    for path in sorted((state_dir / JOURNAL_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            rootfs = Path(data["rootfs"])
            for r in data["links"]:
                try:
                    _unlink_inside(rootfs, r["link"])
                    n += 1
                except FileNotFoundError:
                    pass
                except OSError:
                    log.warning("could not remove %s from %s", r["link"], rootfs, exc_info=True)
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("link-remap journal %s", path, exc_info=True)
        _drop_journal(path)
    for tmp in (state_dir / JOURNAL_DIR).glob("*.tmp"):
        _drop_journal(tmp)  # written before any link was made
    return n


def link_open_unlinked(pids: list[int], rootfs: Path | None = None,
                       journal_path: Path | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Make crabd's hard link next to each open, unlinked, still-linked
    file of `pids` (see the module doc). Returns (the links made, as
    {"orig", "link"} paths in the sandbox's view; the files it could not
    link, with the reason). A file not on the sandbox's root mount cannot
    be kept by the FS commit: a reason. With `journal_path` (and the
    sandbox's `rootfs` on the host), the links are written there before
    they are made; `unlink_all` with the same path removes it."""
    made: list[dict[str, Any]] = []
    missed: list[str] = []
    found = sorted(_candidates(pids).items())
    planned = [(ino, pid, proc_path, orig, f"{os.path.dirname(orig).rstrip('/')}/{LINK_PREFIX}{ino}")
               for (_, ino), (pid, proc_path, orig) in found]
    if planned and journal_path is not None and rootfs is not None:
        _write_journal(journal_path, rootfs, [{"orig": o, "link": ln} for _, _, _, o, ln in planned])
    for _, pid, proc_path, orig, link in planned:
        why = _link_one(pid, proc_path, link)
        if why is None:
            made.append({"orig": orig, "link": link})
        else:
            missed.append(f"{orig} ({why})")
    return made, missed


def unlink_all(rootfs: Path, remaps: list[dict[str, Any]], journal_path: Path | None = None) -> None:
    """Remove the links `remaps` names from `rootfs`, then `journal_path`."""
    for r in remaps:
        try:
            _unlink_inside(rootfs, r["link"])
        except FileNotFoundError:
            pass
        except OSError:
            log.warning("could not remove %s from %s", r["link"], rootfs, exc_info=True)
    _drop_journal(journal_path)


def prepare_restore(rootfs: Path, image_dir: Path, remaps: list[dict[str, Any]],
                    journal_path: Path | None = None) -> list[str]:
    """Link each of crabd's kept links under the name CRIU's image asks for;
    returns the names made (for `cleanup_restore`). With `journal_path`,
    crabd's links and those names are written there first."""
    wanted = linked_remaps(image_dir)
    if journal_path is not None:
        names = [{"link": wanted[r["orig"]]} for r in remaps if r["orig"] in wanted]
        _write_journal(journal_path, rootfs, list(remaps) + names)
    made = []
    for r in remaps:
        name = wanted.get(r["orig"])
        if name is None:
            continue
        try:
            _link_inside(rootfs, r["link"], name)
        except FileExistsError:
            pass
        except OSError:
            log.warning("could not link %s as %s in %s", r["link"], name, rootfs, exc_info=True)
            continue
        made.append(name)
    return made


def cleanup_restore(rootfs: Path, remaps: list[dict[str, Any]], made: list[str],
                    journal_path: Path | None = None) -> None:
    """After a restore, failed or not: crabd's links and any of CRIU's
    names it left (a successful restore removes its own)."""
    unlink_all(rootfs, remaps + [{"link": n} for n in made], journal_path)
