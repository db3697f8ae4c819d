"""Unit tests (no root) for overlay option building and layer merging (deltafs.layers)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafs.errors import InvalidArgument
from deltafs.layers import MAX_OPTIONS_BYTES, LayerEntry, merge_plan, overlay_mount, overlay_options, visible


def test_options_order_and_pinned_flags():
    opts = overlay_options(["/s/l/2", "/s/l/1"], "/s/a/3/u", "/s/a/3/w")
    assert opts[0] == "lowerdir=/s/l/2:/s/l/1"
    assert opts[1:3] == ("upperdir=/s/a/3/u", "workdir=/s/a/3/w")
    assert "redirect_dir=off" in opts and "index=off" in opts and "metacopy=off" in opts


def test_readonly_mount_has_ro_and_no_upper():
    m = overlay_mount(["/s/l/2", "/s/empty"])
    assert m.type == "overlay" and m.options[0] == "ro"
    assert not any(o.startswith("upperdir=") for o in m.options)
    flags, data = m.split_options()
    assert flags & 1 and data.startswith("lowerdir=")


def test_upper_without_work_is_invalid():
    with pytest.raises(InvalidArgument):
        overlay_options(["/a"], upper="/u")
    with pytest.raises(InvalidArgument):
        overlay_options([])


@pytest.mark.parametrize("bad", ["/s:x/l/1", "/s,x/l/1", "/s\\x"])
def test_paths_overlay_cannot_carry_are_refused(bad):
    with pytest.raises(InvalidArgument, match="cannot carry"):
        overlay_options([bad, "/b"])


def test_option_page_limit_names_the_fix():
    lowers = [f"/var/lib/crabd/deltafs/some/long/prefix/l/{i}" for i in range(120)]
    with pytest.raises(InvalidArgument, match="compact"):
        overlay_options(lowers, "/u", "/w")
    # 16 layers under a realistic state dir fit with a wide margin.
    ok = overlay_options([f"/var/lib/crabd/deltafs/l/{i}" for i in range(100000, 100017)], "/u", "/w")
    assert len(",".join(ok)) < MAX_OPTIONS_BYTES // 4


D, W, O = LayerEntry("dir"), LayerEntry("whiteout"), LayerEntry("other")  # noqa: E741  (a table of layers)
OD = LayerEntry("dir", opaque=True)


def test_merge_keeps_whiteouts_and_upper_wins():
    top = {b"": D, b"a": W, b"b": O}
    low = {b"": D, b"b": D, b"b/x": O, b"c": O}
    plan = merge_plan([top, low])
    assert plan[b"a"] == (0, False)          # whiteout kept: hides layers below the run
    assert plan[b"b"] == (0, False)          # file over dir: file wins
    assert b"b/x" not in plan                # hidden by the file above
    assert plan[b"c"] == (1, False)


def test_merge_dir_over_whiteout_becomes_opaque():
    top = {b"": D, b"d": D, b"d/new": O}
    low = {b"": D, b"d": W}
    plan = merge_plan([top, low])
    assert plan[b"d"] == (0, True)


def test_merge_opaque_dir_hides_lower_children_only():
    top = {b"": D, b"d": OD, b"d/keep": O}
    low = {b"": D, b"d": D, b"d/gone": O}
    plan = merge_plan([top, low])
    assert b"d/gone" not in plan and plan[b"d/keep"] == (0, False) and plan[b"d"] == (0, True)


def test_merge_lower_opaque_propagates():
    top = {b"": D, b"d": D, b"d/a": O}
    low = {b"": D, b"d": OD, b"d/b": O}
    plan = merge_plan([top, low])
    assert plan[b"d"] == (0, True) and plan[b"d/b"] == (1, False)


# ---- property: merging any run of adjacent layers changes nothing visible ----------
_names = st.sampled_from([b"a", b"b", b"c"])
_entry = st.sampled_from([D, OD, W, O, O])


@st.composite
def layer(draw):
    out = {b"": D}
    def fill(prefix: bytes, depth: int):
        for n in draw(st.lists(_names, unique=True, max_size=3)):
            p = prefix + b"/" + n if prefix else n
            e = draw(_entry)
            out[p] = e
            if e.kind == "dir" and depth < 2:
                fill(p, depth + 1)
    fill(b"", 0)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(layer(), min_size=2, max_size=6), st.data())
def test_merged_run_shows_the_same_tree(layers, data):
    i = data.draw(st.integers(0, len(layers) - 2))
    j = data.draw(st.integers(i + 2, len(layers)))
    plan = merge_plan(layers[i:j])
    merged = {p: (LayerEntry("dir", op) if layers[i + src][p].kind == "dir" else layers[i + src][p])
              for p, (src, op) in plan.items()}
    before = visible(layers)
    after = visible(layers[:i] + [merged] + layers[j:])

    def origin(idx: int, path: bytes) -> int:
        if idx < i:
            return idx
        if idx == i:                     # the merged layer: map back to the layer it kept
            return i + plan[path][0]
        return idx + (j - i) - 1

    assert {p: origin(k, p) for p, k in after.items()} == before
