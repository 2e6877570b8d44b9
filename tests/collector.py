"""What a call leaves to the garbage collector (tests/test_reference_cycles.py, and
benchmarks/region_overhead.py's ``amortized`` part)."""

import gc
from typing import Any, Callable


def left_in_cycles(fn: Callable[[], Any]) -> list[Any]:
    """The objects one call of ``fn`` leaves in reference cycles: what a collection finds after
    the call ran with the collector off (call ``fn`` once before, so that what caches keep is
    not counted). What was alive before the call is frozen meanwhile (``gc.freeze``): the
    collection that finds the call's cycles walks the call's objects, not the whole heap of a
    test process that has run hundreds of tests (~0.5 s a collection there). (Not where the
    process froze objects itself: ``gc.unfreeze`` would thaw those too.)"""
    freezes = gc.get_freeze_count() == 0
    gc.collect()
    if freezes:
        gc.freeze()
    gc.disable()
    try:
        fn()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
    finally:
        gc.set_debug(0)
        gc.enable()
        if freezes:
            gc.unfreeze()
    found, gc.garbage[:] = list(gc.garbage), []
    return found
