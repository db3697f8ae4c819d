"""The shared test images exist (busybox, debian-py): made here once, by the
first integration run of scripts/run-tests, before its two side-by-side runs
(which would otherwise both build a missing one at the same time)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.needs("root", "busybox", "debian-py")


def test_the_shared_images_exist(runtime, busybox_image, debian_image):
    assert runtime.images.exists(busybox_image) and runtime.images.exists(debian_image)
