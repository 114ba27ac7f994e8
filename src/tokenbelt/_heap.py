"""The collector and a long-running process."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object the process holds out of the collector's
    reach (``gc.freeze``): what a server imported and built before its first request
    lives as long as it does, and a full collection over it stops every thread, the
    one that writes a stream's tokens or releases a stopped request included. Later
    full collections scan only what serving made since. Measured with the default
    model (``tokenbelt serve``, worker isolation, after three requests): a full
    collection in the server took 49-59 ms before (103,000 objects), 5-6 ms after
    (82,000 frozen); in the engine worker 12-15 ms before, 0.1 ms after."""
    gc.collect()
    gc.freeze()
