"""Pieces shared by the end-to-end tests, the demo and the benchmarks.

* :class:`PickerProcess` runs ``python -m epp serve`` as a child process (so its CPU time can be
  read from /proc and SIGTERM really is a signal) and waits until its readiness is SERVING.
* :func:`wait_for_picker` waits until Envoy's health check has admitted the picker: Envoy is ready
  before its first health check round has passed, and the bootstrap disables panic routing, so
  traffic sent earlier would fail (fail-closed) or bypass the picker (fail-open).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.envoy.bootstrap import EPP_CLUSTER
from epp.testing.envoy import EnvoyProcess, free_port, free_ports
from epp.testing.processes import stop_process

__all__ = ["PickerProcess", "child_pids", "cpu_seconds", "wait_for_picker"]


def wait_for_picker(envoy: EnvoyProcess, *, healthy: bool = True, timeout: float = 15.0) -> None:
    """Block until Envoy counts the picker healthy (or, with ``healthy=False``, unhealthy)."""
    want = 1 if healthy else 0
    deadline = time.monotonic() + timeout
    name = f"cluster.{EPP_CLUSTER}.membership_healthy"
    while True:
        value = envoy.stats(rf"^cluster\.{EPP_CLUSTER}\.membership_healthy$").get(name)
        if value == want:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"Envoy did not see the picker {'healthy' if healthy else 'unhealthy'} in {timeout}s")
        time.sleep(0.05)


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User + system CPU seconds used so far by process ``pid``, its threads and (unless
    ``children=False``) its live child processes (the picker's scrape worker), from /proc."""
    return sum(cpu_times(pid, children=children))


def cpu_times(pid: int, *, children: bool = True) -> tuple[float, float]:
    """(user, system) CPU seconds of :func:`cpu_seconds`: the system part is the kernel's work for the
    process (its syscalls, the wake-ups, and on loopback the peer's side of TCP that its sends run)."""
    user = system = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rpartition(")")[2].split()
        except FileNotFoundError:
            continue
        user += int(fields[11]) / os.sysconf("SC_CLK_TCK")
        system += int(fields[12]) / os.sysconf("SC_CLK_TCK")
        if children:
            pending += child_pids(current)
    return user, system


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid`` (of any of its threads), from /proc; none if it is gone."""
    children: list[int] = []
    try:
        for listing in Path(f"/proc/{pid}/task").glob("*/children"):
            children += [int(child) for child in listing.read_text().split()]
    except FileNotFoundError:  # the process, or one of its threads, ended while it was read
        pass
    return children


# How much of a stopped picker's log is kept in memory for log_tail() once its file is removed.
_KEPT_LOG_CHARS = 256 * 1024


def _new_log() -> IO[bytes]:
    return tempfile.NamedTemporaryFile(prefix="epp-picker-", suffix=".log", delete=False)  # closed in stop()


class PickerProcess:
    """``python -m epp serve`` on 127.0.0.1 with free ports, plaintext unless ``tls``.

    ``endpoints=None`` passes no ``--endpoints``: the pool comes from ``extra_args`` (``--pool-name`` and a
    ``--kubeconfig``, for one). The ports are chosen once: a picker started again after :meth:`stop`
    (or after its process was killed) listens where Envoy expects it. ``python``: the interpreter
    (another virtualenv's, to run another tree's picker side by side in a bench). ``env``: variables set for
    the picker's process (and so its workers) over this one's environment (``LD_PRELOAD``, glibc's
    ``MALLOC_*`` tunables: one picker's allocator changed, not the Envoy's and the pods' beside it).
    """

    def __init__(
        self,
        endpoints: Sequence[str] | None,
        *,
        tls: bool = False,
        extra_args: Sequence[str] = (),
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.env = dict(env or {})
        self.grpc_port, self.health_port, self.metrics_port = free_ports(3)
        self.args = [
            python, "-m", "epp", "serve",
            "--bind-address", "127.0.0.1",
            "--grpc-port", str(self.grpc_port),
            "--grpc-health-port", str(self.health_port),
            "--metrics-port", str(self.metrics_port),
            f"--secure-serving={'true' if tls else 'false'}",
            *(["--endpoints", ",".join(endpoints)] if endpoints is not None else []),
            *extra_args,
        ]  # fmt: skip
        self._log = _new_log()
        self._last_log = ""  # what the log held when stop() removed its file
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def log_path(self) -> str:
        return self._log.name

    def start(self, timeout: float = 60.0) -> None:
        # A deadline, not a measurement: generous, since a loaded 2-core machine starts it slowly.
        if self._log.closed:  # started again after stop(): a new log
            self._log = _new_log()
        # PYTHONSAFEPATH: neither the picker nor its scrape worker imports epp from the working
        # directory (another tree's python, in a bench side by side, must get its own tree's).
        environment = {**os.environ, "PYTHONSAFEPATH": "1", **self.env}

        def spawn() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                self.args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=environment
            )

        self.process = spawn()
        deadline = time.monotonic() + timeout
        retries = 3
        while self.health("readiness") != health_pb2.HealthCheckResponse.SERVING:
            if self.process.poll() is not None:
                if retries and self._move_taken_port():
                    retries -= 1
                    self._log.close()
                    os.unlink(self._log.name)
                    self._log = _new_log()
                    self.process = spawn()
                    continue
                raise RuntimeError(f"the picker exited with status {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the picker was not ready in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def _move_taken_port(self) -> bool:
        """After an exit because another process took a port between :func:`free_port` and the bind:
        a new port for the health or metrics listener (nobody else was told those). False for the
        gRPC port (Envoy was configured with it) or any other failure."""
        tail = self.log_tail()
        if "Address already in use" not in tail:
            return False
        for flag, attribute in (("--grpc-health-port", "health_port"), ("--metrics-port", "metrics_port")):
            if f"{flag} " in tail:
                port = free_port()
                self.args[self.args.index(flag) + 1] = str(port)
                setattr(self, attribute, port)
                return True
        return False

    def health(self, service: str = "") -> int:
        """The health status of ``service`` on the health port (UNKNOWN when unreachable)."""
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=0.5
                )
            except grpc.RpcError:
                return health_pb2.HealthCheckResponse.UNKNOWN
            return reply.status

    def terminate(self) -> None:
        """Send SIGTERM (graceful drain); :meth:`wait` for the exit status."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Stop the picker (SIGTERM, then SIGKILL after 10 s) and remove its log file; what the log
        held stays readable through :meth:`log_tail`."""
        if self.process is not None:
            stop_process(self.process)
        if not self._log.closed:
            self._log.close()
            path = Path(self._log.name)
            self._last_log = path.read_text(errors="replace")[-_KEPT_LOG_CHARS:]
            path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        if self._log.closed:
            text = self._last_log
        else:
            self._log.flush()
            text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> PickerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
