"""Stopping a child process the way every launcher here does: SIGTERM, a grace period, then SIGKILL.

The launchers (:mod:`epp.testing.envoy`, :mod:`epp.testing.peers`, :mod:`epp.testing.vllm`, the
benches' simulators) start their processes, often in a session of their own so that a process group
takes the children with it, and end only what they started, by PID. A process already reaped is
never signalled: its PID may have been reused.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["signal_group", "stop_process"]


def signal_group(pid: int, signum: signal.Signals) -> None:
    """Send ``signum`` to the process group led by ``pid`` (nothing if it is gone already)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def stop_process(process: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 10.0, *,
                 group: bool = False) -> None:  # fmt: skip
    """SIGTERM ``process`` (its whole group with ``group=True``: it must lead a session of its own), wait
    up to ``grace`` seconds, then SIGKILL it; reaped either way. Nothing if it has exited already."""
    if process.poll() is not None:
        return
    if group:
        signal_group(process.pid, signal.SIGTERM)
    else:
        process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        if group:
            signal_group(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait()
