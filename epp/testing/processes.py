"""Stopping a child process the way every launcher here does: SIGTERM, a grace period, then SIGKILL.

The launchers (:mod:`epp.testing.envoy`, :mod:`epp.testing.peers`, :mod:`epp.testing.vllm`, the
benches' simulators) start their processes, often in a session of their own so that a process group
takes the children with it, and end only what they started, by PID. A process already reaped is
never signalled: its PID may have been reused. Each launcher also keeps what it started and has not
stopped, and hands that collection to :func:`stop_at_exit`, so an interpreter that ends without
stopping them (an interrupted run, a failed fixture) does not leave them running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
from collections.abc import Collection
from typing import Protocol

__all__ = ["signal_group", "stop_at_exit", "stop_process"]


class Stoppable(Protocol):
    def stop(self) -> None: ...


def stop_at_exit(running: Collection[Stoppable]) -> None:
    """Stop, when this interpreter exits, whatever is still in ``running`` then (each ``stop`` removes
    itself from it)."""

    def stop_all() -> None:
        for each in list(running):
            each.stop()

    atexit.register(stop_all)


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
