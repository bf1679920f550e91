"""What a started picker process does to itself: its allocator's arenas before anything starts a
thread, its collector once it has started."""

from __future__ import annotations

import gc
import os

from epp._libc import glibc_function

__all__ = ["MALLOC_ARENAS", "freeze_startup_objects", "limit_malloc_arenas"]

MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's <malloc.h>


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> int | None:
    """Cap glibc malloc's arenas at ``arenas``, unless the operator chose (``MALLOC_ARENA_MAX`` or a
    ``GLIBC_TUNABLES`` arena setting, which glibc applied at start). Returns the cap set, or None.

    Why. glibc gives each thread that allocates an arena of its own while there are fewer than 8 per
    core (16 here). The precise producer's encodings run on threads (the Rust tokenizer's buffers, the
    ids' lists, a rest's text), and much of what they allocate is freed on the event loop's thread, a
    few milliseconds later: each thread arena fragments on its own, and its resident size wanders up
    and rarely comes back. Side by side in one run, ``bench/soak.py --precise --minutes 15`` (2 pods,
    new prompts only: cold heads, rests on the threads, prompts over 16 KiB; at edda848), without a
    cap and with ``MALLOC_ARENA_MAX=2``: RSS 116.3 -> 118.4 MiB after the warm-up, **18.4 bytes a
    request**, against 112.8 -> 112.6 MiB, **-3.1**; picker CPU 2.88 and 2.83 ms a request
    (138 and 142 requests/s). Over 30 minutes, the same two side by side (edda848 against fa5dfc6,
    which caps here): 115.1 -> 118.9 MiB, **8.6 bytes a request**, against 111.1 -> 112.1 MiB, **3.0**
    (the capped picker's RSS still rose until ~60k requests, then stayed level); CPU 3.28 and 3.41
    ms a request (110 requests/s each). The growth was in the thread arenas (in ``/proc/PID/smaps`` six
    minutes apart, two of the three grew by 0.8 and 2.6 MiB; the main heap stayed at 35.5 MiB).
    With two arenas every thread shares one of two, and what one frees is reused by the others.
    Alone for 30 minutes at e43b67b: 1.81 bytes a request over 332,752 requests; for an hour at 46a054f,
    0.72, the RSS wandering 110.8-114.2 MiB with no trend (``bench/soak.py``'s docstring). A
    ``malloc_trim(0)`` every 10 s on a thread, tried beside the cap (a sitecustomize probe, the two
    soaks side by side on a machine also running the test suite): 4.8 against 10.5 bytes a request, the
    RSS jumping by MiBs either way; each trim cost 0.9 ms of CPU and held the arenas' locks up to 35 ms
    (wall), a stall for any thread that allocates meanwhile, the event loop's included: not adopted. Nor
    holding glibc's mmap threshold at its starting 128 KiB (``M_MMAP_THRESHOLD``; glibc raises it to the
    size of each mapped block freed, and here it rose above the Rust tokenizer's passing buffers, its
    pre-tokenizer's splits and alignments of 150-650 KiB, which then come from the heap: ``perf``
    counted no mmap in 20 s of the capped picker, and 3,210 with the threshold held, 98% of them from
    inside ``tokenizers``). Side by side with the cap alone, ``bench/soak.py --precise``: over 15
    minutes 3.8 against 14.3 bytes a request, but over 30 (72e3a7f against 18a3d6d, 108 and 103
    requests/s) 3.48 against 1.00, its RSS 5 MiB lower yet still rising (106.1 -> 107.1 MiB after the
    warm-up, where the cap alone wandered 108.8-113.5 with no trend), for 10% more CPU (4.24 against
    3.85 ms a request: ~88 page faults a request, every mapped block's pages fresh).
    The default path, which encodes nothing on threads, was already flat (0.07 bytes a request,
    ``python bench/soak.py``).

    Called first thing by the command line's picker and by each of its ext_proc workers (the scrape
    worker, which encodes nothing, is left as glibc sets it): a cap binds arenas not made yet, so it
    must come before a thread allocates. Elsewhere than glibc (musl, macOS) there are no per-thread
    arenas to cap, and nothing is done.
    """
    if os.environ.get("MALLOC_ARENA_MAX") or "arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    mallopt = glibc_function("mallopt")
    if mallopt is None:
        return None
    return arenas if mallopt(_M_ARENA_MAX, arenas) == 1 else None


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
