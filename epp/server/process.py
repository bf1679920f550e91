"""What a started picker process does to itself once it has started."""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_objects"]


def freeze_startup_objects() -> None:
    """Collect, then move every object alive now out of the collector's reach (``gc.freeze``).

    What a started picker holds (modules, the config, plugins, protobuf classes: ~68k of the ~76k
    objects a precise picker tracks in the middle of workload b) lives as long as the process, and a
    full pass of the collector walked all of it, with the event loop stopped. Full passes are rare
    (none came in 40 s of workload b; they come as long-lived objects accumulate, over hours), but
    each one was a pause for every stream: forced 30 s into workload b, **42.5 ms**, and 2.0 ms once
    frozen (``python bench/precise_routing.py --workloads b --policies
    precise@bench/gcprobe/frozen,precise@bench/gcprobe/unfrozen --rounds 1``, see
    ``bench/gcprobe/sitecustomize.py``; the young generations' passes, 0.1 and 1-2 ms, are the
    same either way). Called once a process has started, by the command line and by each worker: a
    test process that starts pickers in-process keeps its collector as it is.
    """
    gc.collect()
    gc.freeze()
