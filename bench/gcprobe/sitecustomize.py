"""A probe of the garbage collector's pauses in a picker process (``bench/gcprobe``).

Run a picker policy of ``bench/precise_routing.py`` (or ``routing_quality.py``) under one of this
folder's interpreters: ``python bench/precise_routing.py --workloads b --policies
precise@bench/gcprobe/frozen,precise@bench/gcprobe/unfrozen --rounds 1``. Loaded by the picker's
interpreter (``PYTHONPATH`` set by the wrapper), it times every collection through ``gc.callbacks``
and, 30 s after the process started, forces one full pass, as one comes when long-lived objects
accumulate (rare: none came in 40 s of workload b); ``unfrozen`` first undoes the picker's
``gc.freeze`` of its startup objects (:mod:`epp.server.process`), to time the pass as it was before.
Every 5 s it writes ``$TMPDIR/epp-gcprobe.<pid>``: objects tracked, objects frozen, per generation
the count and the total and largest pause, and each full pass (seconds since start, ms).
"""

import gc
import os
import sys
import tempfile
import threading
import time

_T0 = time.perf_counter()
_started: list[float] = []
_pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
_full: list[tuple[float, float]] = []


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _started[:] = [time.perf_counter()]
        return
    pause = time.perf_counter() - _started[0]
    _pauses[info["generation"]].append(pause)
    if info["generation"] == 2:
        _full.append((round(time.perf_counter() - _T0, 1), round(pause * 1000, 2)))


def _report() -> None:
    path = os.path.join(tempfile.gettempdir(), f"epp-gcprobe.{os.getpid()}")
    ticks = 0
    while True:
        time.sleep(5)
        ticks += 1
        if ticks == 6:
            if os.environ.get("EPP_GCPROBE_UNFREEZE") == "1":
                gc.unfreeze()
            gc.collect()
        with open(path, "w") as out:
            out.write(f"{' '.join(sys.argv[:3])} unfrozen={os.environ.get('EPP_GCPROBE_UNFREEZE') == '1'} "
                      f"tracked={len(gc.get_objects())} frozen={gc.get_freeze_count()}\n")
            for generation, pauses in _pauses.items():
                if pauses:
                    out.write(f"gen{generation}: {len(pauses)} passes, {sum(pauses) * 1000:.1f} ms in all, "
                              f"largest {max(pauses) * 1000:.2f} ms\n")
            out.write(f"full passes (s since start, ms): {_full}\n")


if "serve" in sys.argv:  # the picker (not its scrape worker, nor other children)
    gc.callbacks.append(_callback)
    threading.Thread(target=_report, name="epp-gcprobe", daemon=True).start()
