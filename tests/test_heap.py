"""The heap a timed decode runs against (pipeline.decode.heap): inside ``frozen_heap`` what
existed before is left out of collections, cycles made inside are still collected, and on
the way out (an error included) the heap is as collectable as before, unless it was frozen for
good (a serving replica's)."""

from __future__ import annotations

import gc
import weakref

import pytest

from pipeline.decode.heap import freeze_startup_heap, frozen_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_the_heap_is_frozen_inside_and_collectable_again_after():
    before = Node()
    ref_before = weakref.ref(before)
    del before
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        inside = Node()
        ref_inside = weakref.ref(inside)
        del inside
        gc.collect()
        assert ref_inside() is None  # made inside: collected inside
    assert gc.get_freeze_count() == 0
    assert ref_before() is None  # frozen_heap's own collection freed it before freezing


def test_an_error_inside_unfreezes_the_heap():
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("a decode failed")
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_for_good_stays_frozen():
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        with frozen_heap():
            made_inside = [Node() for _ in range(10)]
        assert gc.get_freeze_count() >= frozen > 0
        del made_inside
    finally:
        gc.unfreeze()  # (the test process itself goes on collecting)
