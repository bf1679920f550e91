"""epp.server.process: what a started picker process does to itself (glibc malloc's arenas here; the
collector's freeze is tested with the started picker in test_server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epp.testing.harness import PickerProcess

pytestmark = pytest.mark.skipif(
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


def test_threads_share_two_arenas_once_capped(tmp_path: Path) -> None:
    assert _arenas(tmp_path, limit=False) == ("uncalled", 7)  # glibc's default: one per thread here
    assert _arenas(tmp_path, limit=True) == ("2", 2)


def test_the_operators_setting_wins(tmp_path: Path) -> None:
    assert _arenas(tmp_path, limit=True, env={"MALLOC_ARENA_MAX": "4"}) == ("None", 4)
    assert _arenas(tmp_path, limit=True, env={"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}) == ("None", 3)


def test_the_command_lines_picker_caps_its_arenas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the picker has started (its collector frozen), six more threads still share two arenas."""
    report = tmp_path / "arenas"
    (tmp_path / "sitecustomize.py").write_text(
        _ARENAS_PROBE + "import gc, sys, time\n"
        "if 'serve' in sys.argv:\n"
        "    def later():\n"
        "        while gc.get_freeze_count() == 0:\n"
        "            time.sleep(0.05)\n"
        f"        count = arenas_after_threads({str(tmp_path / 'info.xml')!r})\n"
        f"        open({str(report)!r}, 'w').write(str(count))\n"
        "    threading.Thread(target=later, daemon=True).start()\n"
    )
    previous = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + (os.pathsep + previous if previous else ""))
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    picker = PickerProcess(["127.0.0.1:1"], extra_args=["--scrape-metrics=false"])
    picker.start()
    try:
        deadline = time.monotonic() + 30
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert report.read_text() == "2"
    finally:
        picker.stop()
