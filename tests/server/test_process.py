"""epp.server.process: what a started picker process does to itself (glibc malloc's arenas and mmap
threshold, the collector's freeze)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epp.testing.harness import PickerProcess

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "glibc" not in (os.confstr("CS_GNU_LIBC_VERSION") or ""),
    reason="per-thread arenas are glibc's",
)

# Six threads alive at once, each allocating, then glibc's own account of its arenas (malloc_info's
# <heap> elements): a thread that allocates gets an arena of its own while the cap allows.
_ARENAS_PROBE = """
import ctypes, threading

def arenas_after_threads(path):
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    barrier = threading.Barrier(7)
    def allocate():
        libc.malloc(256)
        barrier.wait()
        barrier.wait()
    threads = [threading.Thread(target=allocate) for _ in range(6)]
    for thread in threads:
        thread.start()
    barrier.wait()
    report = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(report))
    libc.fclose(ctypes.c_void_p(report))
    barrier.wait()
    for thread in threads:
        thread.join()
    return open(path).read().count("<heap nr=")
"""


_MALLOC_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def _arenas(tmp_path: Path, limit: bool, env: dict[str, str] | None = None) -> tuple[str, int]:
    script = _ARENAS_PROBE + (
        "from epp.server.process import tune_malloc\n"
        f"result = tune_malloc().get('arena_max') if {limit} else 'uncalled'\n"
        f"print(result, arenas_after_threads({str(tmp_path / 'info.xml')!r}))\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in _MALLOC_SETTINGS}
    out = subprocess.run([sys.executable, "-c", script], env={**environment, **(env or {})},
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@glibc
def test_threads_share_two_arenas_once_capped(tmp_path: Path) -> None:
    assert _arenas(tmp_path, limit=False) == ("uncalled", 7)  # glibc's default: one per thread here
    assert _arenas(tmp_path, limit=True) == ("2", 2)


@glibc
def test_the_operators_setting_wins(tmp_path: Path) -> None:
    assert _arenas(tmp_path, limit=True, env={"MALLOC_ARENA_MAX": "4"}) == ("None", 4)
    assert _arenas(tmp_path, limit=True, env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}) == ("None", 3)


# A 1 MiB block mapped and freed, then a 512 KiB one: is it mapped too (mallinfo2's count of mapped
# blocks), or carved from the heap because the first free raised the threshold to 1 MiB?
_THRESHOLD_PROBE = """
import ctypes

def mapped_after_a_larger_free():
    libc = ctypes.CDLL(None)
    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(1 << 20))
    before = libc.mallinfo2().hblks
    block = libc.malloc(512 << 10)
    mapped = libc.mallinfo2().hblks - before
    libc.free(block)
    return mapped
"""


def _threshold(tune: bool, env: dict[str, str] | None = None) -> tuple[str, int]:
    script = _THRESHOLD_PROBE + (
        "from epp.server.process import tune_malloc\n"
        f"result = tune_malloc().get('mmap_threshold') if {tune} else 'uncalled'\n"
        "print(result, mapped_after_a_larger_free())\n"
    )
    environment = {k: v for k, v in os.environ.items() if k not in _MALLOC_SETTINGS}
    out = subprocess.run([sys.executable, "-c", script], env={**environment, **(env or {})},
                         capture_output=True, text=True, check=True, timeout=60).stdout.split()  # fmt: skip
    return out[0], int(out[1])


@glibc
def test_the_mmap_threshold_is_held_where_glibc_starts_it() -> None:
    # glibc's default: the freed 1 MiB block raised the threshold, the 512 KiB one came from the heap.
    assert _threshold(tune=False) == ("uncalled", 0)
    assert _threshold(tune=True) == ("131072", 1)


@glibc
def test_the_operators_mmap_threshold_wins() -> None:
    assert _threshold(tune=True, env={"MALLOC_MMAP_THRESHOLD_": "2000000"}) == ("None", 0)
    assert _threshold(tune=True, env={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=2000000"}) == ("None", 0)
    # Setting the other one leaves this one to the picker.
    assert _threshold(tune=True, env={"MALLOC_ARENA_MAX": "4"}) == ("131072", 1)


def _once_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prelude: str, expression: str) -> str:
    """``str(expression)`` evaluated in the command line's picker once it has started (its collector
    frozen), by a sitecustomize module on its PYTHONPATH after ``prelude``."""
    report = tmp_path / "report"
    (tmp_path / "sitecustomize.py").write_text(
        prelude + "import gc, os, sys, threading, time\n"
        "if 'serve' in sys.argv:\n"
        "    def later():\n"
        "        while gc.get_freeze_count() == 0:\n"
        "            time.sleep(0.05)\n"
        f"        open({str(report)!r} + '.part', 'w').write(str({expression}))\n"
        f"        os.replace({str(report)!r} + '.part', {str(report)!r})\n"  # whole when it appears
        "    threading.Thread(target=later, daemon=True).start()\n"
    )
    previous = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + previous if previous else ""))
    picker = PickerProcess(["127.0.0.1:1"], extra_args=["--scrape-metrics=false"])
    picker.start()
    try:
        deadline = time.monotonic() + 30
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return report.read_text()
    finally:
        picker.stop()


def test_a_started_picker_process_freezes_its_startup_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's picker moves what it holds once started out of the collector's full passes
    (a test process starting pickers in-process does not)."""
    assert int(_once_started(tmp_path, monkeypatch, "", "gc.get_freeze_count()")) > 10_000


@glibc
def test_the_command_lines_picker_caps_its_arenas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the picker has started, six more threads still share two arenas."""
    for name in _MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    info = str(tmp_path / "info.xml")
    assert _once_started(tmp_path, monkeypatch, _ARENAS_PROBE, f"arenas_after_threads({info!r})") == "2"


@glibc
def test_the_command_lines_picker_holds_its_mmap_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the picker has started (its prompts' buffers come and go), a freed large block does not
    move the threshold: a smaller block above it is still mapped on its own."""
    for name in _MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert _once_started(tmp_path, monkeypatch, _THRESHOLD_PROBE, "mapped_after_a_larger_free()") == "1"
