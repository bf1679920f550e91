"""epp.testing.vllm without vLLM: what a server is started with."""

from __future__ import annotations

import os
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
