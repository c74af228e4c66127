"""epp serve's garbage-collector tuning: startup's objects frozen, young threshold raised."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from epp.gc_tuning import YOUNG_THRESHOLD, settle_heap


@pytest.fixture
def restored() -> Iterator[None]:
    """The test session's collector settings, put back afterwards."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored")
def test_startup_objects_are_frozen_and_young_threshold_raised() -> None:
    gc.set_threshold(700, 10, 10)
    before = gc.get_freeze_count()
    settle_heap()
    assert gc.get_freeze_count() > before
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)


@pytest.mark.usefixtures("restored")
def test_cycles_made_after_settling_are_still_collected() -> None:
    settle_heap()

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
