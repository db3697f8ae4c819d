"""Overlay layers as pure data: mount option building and layer merging.

The overlay driver stores committed snapshots as overlayfs layers (whiteouts
are 0/0 character devices, an opaque directory carries the
``trusted.overlay.opaque=y`` xattr). Two pieces of its logic need no kernel
and live here so they are unit-tested without root:

* `overlay_options` builds the mount(2) data string for a chain of layers
  and refuses one that would not fit in the single page mount(2) copies in.
* `merge_plan` decides, for a run of adjacent layers, which entry of which
  layer the merged (compacted) layer keeps. `visible` is an independent,
  per-path model of what overlayfs shows for a stack of layers; the unit
  tests check merge_plan against it. `overlayfs-tools` is not packaged for
  Debian, so compaction is this code.

A layer listing maps a relative path (bytes, b"" = root) to a `LayerEntry`.
Paths sort parents-first under plain bytes ordering (a prefix sorts first).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument
from .mount import Mount

__all__ = ["LayerEntry", "overlay_options", "overlay_mount", "merge_plan", "visible", "MAX_OPTIONS_BYTES",
           "check_layer_path"]

# mount(2) copies the data argument into one page; overlayfs rejects a
# truncated option string, so the whole "lowerdir=...,upperdir=..." must fit.
MAX_OPTIONS_BYTES = 4095

# Options pinned for every overlay mount this driver makes, and why:
# - index=off, metacopy=off: the upper dir must hold whole files and no
#   index, so that it can be captured as a self-contained layer;
# - redirect_dir=off: renamed merged directories would otherwise be stored as
#   redirect xattrs pointing into lower layers, which a layer copied out of
#   the upper dir cannot carry (with it off, rename(2) of a lower dir returns
#   EXDEV and tools fall back to copy+delete, as on any pre-4.10 kernel).
PINNED_OPTIONS = ("index=off", "metacopy=off", "redirect_dir=off")


def check_layer_path(path: str) -> None:
    """overlayfs splits lowerdir on ':' and options on ','; those paths cannot be escaped portably."""
    for ch in (":", ",", "\\", "\n"):
        if ch in path:
            raise InvalidArgument(
                f"path {path!r} contains {ch!r}, which overlayfs mount options cannot carry; "
                "choose a state directory without ':', ',', '\\' or newlines")


def overlay_options(lowers: list[str], upper: str | None = None, work: str | None = None) -> tuple[str, ...]:
    """Mount options for an overlay of `lowers` (top-most first), writable when upper/work given. Pure."""
    if not lowers:
        raise InvalidArgument("an overlay needs at least one lower layer")
    if (upper is None) != (work is None):
        raise InvalidArgument("upperdir and workdir go together")
    for p in lowers + [p for p in (upper, work) if p]:
        check_layer_path(p)
    opts = ["lowerdir=" + ":".join(lowers)]
    if upper is not None:
        opts += ["upperdir=" + upper, "workdir=" + str(work)]
    opts += list(PINNED_OPTIONS)
    total = len(",".join(opts).encode())
    if total > MAX_OPTIONS_BYTES:
        raise InvalidArgument(
            f"overlay mount options are {total} bytes for {len(lowers)} layers, more than the "
            f"{MAX_OPTIONS_BYTES} mount(2) accepts; compact the chain (Snapshotter.compact) or use a "
            "shorter state directory path")
    return tuple(opts)


def overlay_mount(lowers: list[str], upper: str | None = None, work: str | None = None) -> Mount:
    """One overlay `Mount` spec (read-only when no upper). Pure."""
    opts = overlay_options(lowers, upper, work)
    if upper is None:
        opts = ("ro",) + opts
    return Mount(type="overlay", source="overlay", options=opts)


@dataclass(frozen=True)
class LayerEntry:
    """What merging needs to know about one path of one layer."""

    kind: str  # "dir", "whiteout" or "other" (any non-dir that is not a whiteout)
    opaque: bool = False  # only meaningful for dirs


def _parent(path: bytes) -> bytes | None:
    if not path:
        return None
    i = path.rfind(b"/")
    return path[:i] if i >= 0 else b""


def merge_plan(layers: list[dict[bytes, LayerEntry]]) -> dict[bytes, tuple[int, bool]]:
    """Merge adjacent layers (top-most first) into one layer. Pure.

    Returns path -> (index of the layer whose entry is kept, opaque flag for
    dirs). The result, placed where the run of layers was, shows exactly what
    the run showed over any layers below it: whiteouts are kept (they must
    still hide lower content), a dir is opaque when any merged copy of it was
    opaque (the run hid everything below it), and an entry of a lower layer
    is dropped when an upper layer hides it (whiteout, non-dir or opaque dir
    on the way).
    """
    kept: dict[bytes, tuple[int, bool]] = {}
    kinds: dict[bytes, str] = {}
    # For dirs: index of the top-most layer at which the merged dir became
    # opaque; entries from layers strictly below it are hidden.
    opaque_at: dict[bytes, int] = {}
    for i, layer in enumerate(layers):
        for path in sorted(layer):
            e = layer[path]
            if _hidden(path, i, kinds, opaque_at):
                continue
            if path in kept:
                # A merged dir stops being merged with lower content at the first
                # layer that is opaque there or has a whiteout/non-dir there: the
                # merged layer must then hide whatever lies below the run.
                if kinds[path] == "dir" and path not in opaque_at and (e.kind != "dir" or e.opaque):
                    opaque_at[path] = i
                    kept[path] = (kept[path][0], True)
                continue
            kept[path] = (i, e.kind == "dir" and e.opaque)
            kinds[path] = e.kind
            if e.kind == "dir" and e.opaque:
                opaque_at[path] = i
    return kept


def _hidden(path: bytes, i: int, kinds: dict[bytes, str], opaque_at: dict[bytes, int]) -> bool:
    a = _parent(path)
    while a is not None:
        k = kinds.get(a)
        if k is not None and k != "dir":
            return True
        if a in opaque_at and opaque_at[a] < i:
            return True
        a = _parent(a)
    return False


def visible(layers: list[dict[bytes, LayerEntry]]) -> dict[bytes, int]:
    """What overlayfs shows for `layers` (top-most first): path -> index of the layer it comes from.

    A reference model written per path, the way overlayfs looks names up: a
    directory merges the layers in which it is a directory, from the top,
    until one of them is opaque or a layer has a whiteout / non-dir there; a
    child is looked up only in the layers its parent merged. Used to test
    `merge_plan`; too slow for real trees.
    """
    out: dict[bytes, int] = {}
    # Root merges every layer that has a root entry (all of them in practice).
    merged_dirs: dict[bytes, list[int]] = {}
    root_layers = [i for i, layer in enumerate(layers) if b"" in layer]
    stop = []
    for i in root_layers:
        stop.append(i)
        if layers[i][b""].opaque:
            break
    if not stop:
        return out
    out[b""] = stop[0]
    merged_dirs[b""] = stop
    all_paths = sorted({p for layer in layers for p in layer if p})
    for path in all_paths:
        parent = _parent(path)
        if parent not in merged_dirs:
            continue
        first: int | None = None
        merge: list[int] = []
        for i in merged_dirs[parent]:
            e = layers[i].get(path)
            if e is None:
                continue
            if e.kind == "whiteout":
                break
            if e.kind != "dir":
                if first is None:
                    first = i
                break
            if first is None:
                first = i
            merge.append(i)
            if e.opaque:
                break
        if first is None:
            continue
        out[path] = first
        if layers[first][path].kind == "dir":
            merged_dirs[path] = merge
    return out
