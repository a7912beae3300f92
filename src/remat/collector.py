"""Long calls (tracing, planning) made with the objects that existed before them left out of
the garbage collector's passes."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Leave the objects that exist on entry out of the garbage collector's passes until exit
    (``gc.freeze``, undone by ``gc.unfreeze``), unless the process froze objects itself.

    Tracing and planning make many short-lived objects, which start collections, and each full
    one walks every object of the process: the model, torch's and the graph's own (400
    thousand with a 48-layer GPT-2 traced: 0.3-0.4 s a pass, about one per further budget;
    2.4 s of the 23 s its tracing took). Nothing is collected that would not be otherwise,
    but cycles among the objects made before entry wait until exit.
    """
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
