"""epp.testing.vllm without vLLM: what a server is started with."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from epp.testing.vllm import NICE, start_vllm


def test_a_server_runs_at_the_lowest_cpu_priority_in_its_own_autogroup(tmp_path: Path) -> None:
    # A CPU vLLM server starved the picker and Envoy for seconds at the default priority (the module
    # docstring); a stand-in for its python sleeps, started the same way.
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 30\n")
    python.chmod(0o755)
    server = start_vllm(str(python), tmp_path, "x", kv_events=False)
    try:
        assert os.getpriority(os.PRIO_PROCESS, server.process.pid) == NICE == 19
        autogroup = Path(f"/proc/{server.process.pid}/autogroup")
        if not autogroup.exists():
            pytest.skip("this kernel has no autogroups")
        assert autogroup.read_text().split()[-2:] == ["nice", str(NICE)]
        assert autogroup.read_text() != Path("/proc/self/autogroup").read_text()  # its session's, not ours
    finally:
        server.stop()


def test_a_server_left_running_is_stopped_when_the_interpreter_exits(tmp_path: Path) -> None:
    # A run interrupted while a server started (the tier's data-parallel test stopped it only on a
    # RuntimeError) left it and its engines running: the module stops what it started at exit.
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 60\n")
    python.chmod(0o755)
    script = (
        "from pathlib import Path; from epp.testing.vllm import start_vllm\n"
        f"server = start_vllm({str(python)!r}, Path({str(tmp_path)!r}), 'x', kv_events=False)\n"
        "print(server.process.pid, flush=True)\n"
        "raise KeyboardInterrupt\n"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "KeyboardInterrupt" in child.stderr
    pid = int(child.stdout.split()[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return  # gone, and reaped: its parent, the child interpreter, waited for it
    os.kill(pid, signal.SIGKILL)  # (it must not outlive this test either way)
    pytest.fail(f"the server's process {pid} outlived the interpreter that started it")
