"""What a started picker process does to itself: its allocator's settings before anything starts a
thread, its collector once it has started."""

from __future__ import annotations

import ctypes
import gc
import os

__all__ = ["MALLOC_ARENAS", "MALLOC_MMAP_THRESHOLD", "freeze_startup_objects", "tune_malloc"]

MALLOC_ARENAS = 2
MALLOC_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, held
_M_ARENA_MAX = -8  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def tune_malloc(arenas: int = MALLOC_ARENAS, mmap_threshold: int = MALLOC_MMAP_THRESHOLD) -> dict[str, int]:
    """Cap glibc malloc's arenas at ``arenas`` and hold its mmap threshold at ``mmap_threshold``,
    each unless the operator chose (``MALLOC_ARENA_MAX`` / ``MALLOC_MMAP_THRESHOLD_`` or the
    ``GLIBC_TUNABLES`` setting, which glibc applied at start). Returns what was set, by glibc's
    tunable name (empty off glibc).

    Why: the picker's memory over hours (``bench/soak.py --precise``, where the precise producer
    encodes prompts it never saw, on threads as well as on the loop; the default path encodes
    nothing and was flat without either: 0.07 bytes a request, ``python bench/soak.py``).

    *Arenas.* glibc gives each thread that allocates an arena of its own while there are fewer than 8
    per core (16 here). The precise producer's encodings run on threads (the Rust tokenizer's
    buffers, the ids' lists, a rest's text), and much of what they allocate is freed on the event
    loop's thread, a few milliseconds later: each thread arena fragments on its own, and its resident
    size wanders up and rarely comes back. Side by side in one run, ``bench/soak.py --precise
    --minutes 15`` (2 pods, new prompts only: cold heads, rests on the threads, prompts over 16 KiB;
    at edda848), without a cap and with ``MALLOC_ARENA_MAX=2``: RSS 116.3 -> 118.4 MiB after the
    warm-up, **18.4 bytes a request**, against 112.8 -> 112.6 MiB, **-3.1**; picker CPU 2.88 and
    2.83 ms a request (138 and 142 requests/s). Over 30 minutes, the same two side by side (edda848
    against fa5dfc6, which caps here): 115.1 -> 118.9 MiB, **8.6 bytes a request**, against 111.1 ->
    112.1 MiB, **3.0**; CPU 3.28 and 3.41 ms a request (110 requests/s each). The growth was in the
    thread arenas (in ``/proc/PID/smaps`` six minutes apart, two of the three grew by 0.8 and 2.6
    MiB; the main heap stayed at 35.5 MiB). With two arenas every thread shares one of two, and what
    one frees is reused by the others. Alone for 30 minutes at e43b67b: 1.81 bytes a request, the
    main heap going 34 -> 37 MiB in ten minutes and wandering 36-38 after.

    *The mmap threshold.* An allocation of at least the threshold (128 KiB at start) is mapped on
    its own and unmapped when freed. But glibc raises the threshold to the size of each mapped block
    freed (up to 32 MiB): after the first long prompt's tokenizer buffers (tens of thousands of
    tokens: ids, offsets, the tokens' strings) come and go, blocks of that size are carved from the
    heaps instead, between the small objects that outlive them, and the heap's top can no longer be
    given back. Held at 128 KiB, the threshold stops moving (and the trim threshold with it, at its
    128 KiB). Side by side, ``bench/soak.py --precise --minutes 15`` at 72e3a7f (arenas capped),
    once as it is and once with ``MALLOC_MMAP_THRESHOLD_=131072``: RSS after the warm-up 111.2 ->
    112.8 MiB wandering 108.7-113.3, **14.3 bytes a request**, against 106.2 -> 106.0 MiB within
    105.5-106.5, **3.8**; picker CPU 3.69 and 3.91 ms a request (111 requests/s each).

    Tried and not adopted: a ``malloc_trim(0)`` every 10 s on a thread, beside the arena cap (a
    sitecustomize probe): 4.8 against 10.5 bytes a request, the RSS jumping by MiBs either way; each
    trim cost 0.9 ms of CPU and held the arenas' locks up to 35 ms (wall), a stall for any thread
    that allocates meanwhile, the event loop's included.

    Called first thing by the command line's picker and by each of its ext_proc workers (the scrape
    worker, which encodes nothing, is left as glibc sets it): an arena cap binds arenas not made
    yet, so it must come before a thread allocates. Elsewhere than glibc (musl, macOS) there are no
    per-thread arenas nor a moving threshold, and nothing is done.
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return {}
    except (ValueError, OSError):  # not glibc: the name or its value is unknown
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    chosen = {
        "arena_max": bool(os.environ.get("MALLOC_ARENA_MAX")) or "arena_max" in tunables,
        "mmap_threshold": bool(os.environ.get("MALLOC_MMAP_THRESHOLD_")) or "mmap_threshold" in tunables,
    }
    done: dict[str, int] = {}
    settings = (("arena_max", _M_ARENA_MAX, arenas), ("mmap_threshold", _M_MMAP_THRESHOLD, mmap_threshold))
    for name, option, value in settings:
        if not chosen[name] and mallopt(option, value) == 1:
            done[name] = value
    return done


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
