"""epp.server.process: what a started picker process does to itself (glibc malloc's arenas, the
collector's freeze)."""

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


def _arenas(tmp_path: Path, limit: bool, env: dict[str, str] | None = None) -> tuple[str, int]:
    script = _ARENAS_PROBE + (
        "from epp.server.process import limit_malloc_arenas\n"
        f"result = limit_malloc_arenas() if {limit} else 'uncalled'\n"
        f"print(result, arenas_after_threads({str(tmp_path / 'info.xml')!r}))\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX" and k != "GLIBC_TUNABLES"}
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
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    info = str(tmp_path / "info.xml")
    assert _once_started(tmp_path, monkeypatch, _ARENAS_PROBE, f"arenas_after_threads({info!r})") == "2"
