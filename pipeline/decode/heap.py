"""Python's garbage collector against decoding. A full collection scans every object
the collector tracks; once torch, transformers and the models are loaded that is some 400k
objects, 0.2-0.35 s a collection on the 2-core CPU, paid by whichever step happens to trigger
it. A bench decodes a domain in about a second per policy, so one collection in the wrong
place moved a policy's ratio by 15-20% (docs/online.md, "A pause in the wrong place").

``frozen_heap`` collects once and freezes what exists (gc.freeze: later collections skip it)
for the timed work, then unfreezes, so a long process (the test suite) still collects cycles
made before it. ``freeze_startup_heap`` is for a server's process once its models are loaded,
for good, as vLLM's engine core does after start-up (``freeze_gc_heap``): a request no longer
stalls for a collection of the libraries."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, then leave every object that exists now out of the collections made inside.
    In a process whose heap was frozen for good (freeze_startup_heap) it stays frozen."""
    for_good = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not for_good:
            gc.unfreeze()


def freeze_startup_heap() -> None:
    """Collect, then leave every object that exists now out of every later collection, for
    the rest of the process (a serving replica, once its models are loaded)."""
    gc.collect()
    gc.freeze()
