"""The peers, side by side: sglang-router and vllm-router (Rust routers from PyPI) as child processes.

A bench that compares the picker with another router needs that router running on the same pods,
on 127.0.0.1 only, with a known PID (for its CPU time from /proc) and a clean stop. Both install from
PyPI (``pip install -e '.[bench]'``; versions checked here: sglang-router 0.3.2, whose command is
``smg``, and vllm-router 0.1.17) and run the router in the Python process their command starts (a
Rust extension), so that process's PID is the whole router.

API (small on purpose; reused by the routing benches)::

    from epp.testing.peers import PeerRouter
    with PeerRouter.start("sglang-router", ["127.0.0.1:8001", "127.0.0.1:8002"], policy="cache_aware") as router:
        router.url            # "http://127.0.0.1:PORT": send OpenAI requests here
        router.pid            # the router's process, for epp.testing.harness.cpu_seconds(router.pid)
        router.metrics()      # its Prometheus samples, {"name{labels}": value}
    # left the block: stopped (SIGTERM, SIGKILL after a grace), its log removed

:func:`unavailable` says why a kind cannot run here (not installed), or None.

Facts that shaped the arguments (checked against both versions above):

* **Every listener is bound explicitly.** sglang-router binds its server and its Prometheus
  endpoint to 0.0.0.0 by default; both default to Prometheus port 29000 (which
  ``bench/scrape_cost.py``'s farm also uses). Here ``--host``, ``--port``, ``--prometheus-host``
  and ``--prometheus-port`` are always given, on 127.0.0.1 with free ports. Nothing else listens
  (service discovery, which has its own port flag, stays off).
* **Readiness** is ``GET /readiness`` answering ``{"healthy_workers": N, ...}`` with N = every
  worker given: sglang-router registers workers in the background after it starts listening
  (its first ``/readiness`` can say 0 workers).
* **vllm-router's cache_aware needs token ids from the workers**: for each request it posts the
  body to ``/v1/chat/completions/render`` (or ``/v1/completions/render``) of the pods and builds
  its prefix tree from the returned ``token_ids``. Real vLLM serves these only with
  ``--enable-scale-out``, and so does the simulator (``python -m epp.sim --enable-scale-out``).
  Without them the router logs ``Prefix input preparation unavailable ... preparation_rejected``
  (debug level) and routes with ``outcome="missing_tokens"``; its Prometheus counters say which
  happened: ``vllm_router_kv_routing_inputs_total{result="render"}`` counts token ids received
  (one per pod asked), ``vllm_router_prefix_routing_decisions_total{outcome=...}`` the decisions
  (``prefix_hit``/``prefix_miss`` with tokens, ``missing_tokens`` without). :func:`render_counts`
  reads them.
* sglang-router's cache_aware works on the request text (no tokeniser, no worker calls); on
  start it probes each worker for gRPC (an HTTP/2 preface, which an HTTP/1 server such as the
  simulator logs as a bad request: harmless) and for ``/server_info``/``/model_info``.
* sglang-router waits up to ``--shutdown-grace-period-secs`` (default 180 s) for in-flight
  requests on SIGTERM: 5 s here.
* Both log at info by default; sglang-router writes two access-log lines per request there. The
  routers run at their defaults unless ``log_level`` says otherwise (a deployment's default
  cost is the honest comparison).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import IO

from epp.testing.envoy import free_ports
from epp.testing.processes import stop_at_exit, stop_process

__all__ = ["KINDS", "POLICIES", "PeerError", "PeerRouter", "render_counts", "unavailable", "version"]

KINDS: dict[str, tuple[str, str]] = {
    "sglang-router": ("sglang-router", "smg"),
    "vllm-router": ("vllm-router", "vllm-router"),
}
"""Router kind -> (PyPI distribution, command)."""

POLICIES: dict[str, tuple[str, ...]] = {
    "sglang-router": ("random", "round_robin", "cache_aware", "power_of_two"),
    "vllm-router": ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hash", "sticky_least_loaded"),
}
"""Router kind -> the load-balancing policies it takes without further set-up (``--help`` lists a few
more: sglang-router's ``manual`` needs routing headers, vllm-router's ``kv_aware`` KV-event sources)."""
# Polling readiness: each probe is one local HTTP request; a start takes 0.2-2 s on a loaded machine.
_POLL_S = 0.1
_STOP_GRACE_S = 10.0
_SGLANG_SHUTDOWN_GRACE_S = 5
_running: set[PeerRouter] = set()
stop_at_exit(_running)  # what this interpreter started and did not stop


class PeerError(RuntimeError):
    """A peer router is not installed, failed to start, or was not ready in time."""


def version(kind: str) -> str | None:
    """The installed version of ``kind``'s distribution, or None."""
    _check_kind(kind)
    try:
        return metadata.version(KINDS[kind][0])
    except metadata.PackageNotFoundError:
        return None


def _command(kind: str) -> str | None:
    # The console script beside this interpreter first (a venv that is not activated), then PATH.
    name = KINDS[kind][1]
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def unavailable(kind: str) -> str | None:
    """Why ``kind`` cannot be started here (with how to fix it), or None when it can."""
    _check_kind(kind)
    dist, command = KINDS[kind]
    if version(kind) is None:
        return f"{dist} is not installed: pip install {dist} (or pip install -e '.[bench]')"
    if _command(kind) is None:
        return f"{dist} is installed but its command `{command}` is not beside {sys.executable} nor on PATH"
    return None


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown router kind {kind!r}: choose from {', '.join(KINDS)}")


def _worker_url(worker: str) -> str:
    return worker if worker.startswith(("http://", "https://")) else f"http://{worker}"


class PeerRouter:
    """One running peer router; made by :meth:`start`, ended by :meth:`stop` (or leaving a ``with``)."""

    def __init__(
        self,
        kind: str,
        process: subprocess.Popen[bytes],
        port: int,
        metrics_port: int,
        log: IO[bytes],
        workers: tuple[str, ...],
        policy: str,
    ) -> None:
        self.kind = kind
        self.policy = policy
        self.workers = workers
        self.port = port
        self.metrics_port = metrics_port
        self._process: subprocess.Popen[bytes] | None = process
        self._pid = process.pid
        self._log = log
        self._last_log = ""

    @classmethod
    def start(
        cls,
        kind: str,
        worker_urls: Sequence[str],
        *,
        policy: str = "cache_aware",
        log_level: str | None = None,
        extra_args: Sequence[str] = (),
        timeout: float = 60.0,
    ) -> PeerRouter:
        """Start ``kind`` ("sglang-router" or "vllm-router") in front of ``worker_urls`` (``host:port``
        or ``http://host:port``) with load-balancing ``policy``, listening on 127.0.0.1 only; return
        once every worker is healthy in its ``/readiness``. Raises :class:`PeerError` (with the
        router's log tail) if it is not installed, exits, or is not ready within ``timeout``."""
        _check_kind(kind)
        if policy not in POLICIES[kind]:
            raise ValueError(f"{kind} has no policy {policy!r}: choose from {', '.join(POLICIES[kind])}")
        if not worker_urls:
            raise ValueError("a router needs at least one worker")
        if (why := unavailable(kind)) is not None:
            raise PeerError(why)
        command = _command(kind)
        assert command is not None
        workers = tuple(_worker_url(w) for w in worker_urls)
        port, metrics_port = free_ports(2)
        args = [command, *(["launch"] if kind == "sglang-router" else []),
                "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--worker-urls", *workers, "--policy", policy]  # fmt: skip
        if kind == "sglang-router":
            args += ["--shutdown-grace-period-secs", str(_SGLANG_SHUTDOWN_GRACE_S)]
        if log_level is not None:
            args += ["--log-level", log_level]
        args += list(extra_args)
        log = tempfile.NamedTemporaryFile(prefix=f"epp-{kind}-", suffix=".log", delete=False)  # noqa: SIM115
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )  # a Ctrl-C at the bench does not race its stop()
        router = cls(kind, process, port, metrics_port, log, workers, policy)
        _running.add(router)
        try:
            router._wait_ready(time.monotonic() + timeout)
        except BaseException:
            router.stop()
            raise
        return router

    def _wait_ready(self, deadline: float) -> None:
        assert self._process is not None
        healthy = -1
        while True:
            if self._process.poll() is not None:
                raise PeerError(f"{self.kind} exited with status {self._process.returncode}:\n{self.log_tail()}")
            healthy = self._healthy_workers()
            if healthy == len(self.workers):
                return
            if time.monotonic() > deadline:
                raise PeerError(
                    f"{self.kind} was not ready in time ({max(healthy, 0)} of {len(self.workers)} "
                    f"workers healthy):\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def _healthy_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=2) as response:
                return int(json.loads(response.read()).get("healthy_workers", -1))
        except (OSError, ValueError):  # not listening yet, 503 before any worker, or not JSON
            return -1

    # -- what a running router tells us -------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where to send requests: ``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The router's process id (its Rust threads included; also its process group id)."""
        return self._pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def metrics(self) -> dict[str, float]:
        """The router's Prometheus samples, keyed by ``name{labels}`` as written on its page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            page = response.read().decode(errors="replace")
        samples: dict[str, float] = {}
        for match in _SAMPLE.finditer(page):
            with contextlib.suppress(ValueError):
                samples[match.group(1)] = float(match.group(2))
        return samples

    def log_tail(self, lines: int = 40) -> str:
        if self._log.closed:
            text = self._last_log
        else:
            self._log.flush()
            text = Path(self._log.name).read_text(errors="replace")
        text = _ANSI.sub("", text)
        return "\n".join(text.splitlines()[-lines:])

    # -- stopping -----------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM the router's process group (its own session, so only its processes), SIGKILL after
        10 s; remove its log file (the tail stays readable through :meth:`log_tail`). Idempotent."""
        process, self._process = self._process, None
        # A process already reaped by poll() must not be signalled: its PID may be reused.
        if process is not None:
            stop_process(process, _STOP_GRACE_S, group=True)
        _running.discard(self)
        if not self._log.closed:
            self._log.close()
            path = Path(self._log.name)
            self._last_log = path.read_text(errors="replace")[-_KEPT_LOG_CHARS:]
            path.unlink(missing_ok=True)

    def __enter__(self) -> PeerRouter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PeerRouter({self.kind!r}, policy={self.policy!r}, url={self.url!r}, pid={self._pid})"


def render_counts(samples: dict[str, float]) -> dict[str, float]:
    """From a vllm-router's :meth:`PeerRouter.metrics`: token-id inputs by result (``render``: token
    ids received from a pod's render endpoint; ``preparation_rejected``, ``render_unavailable``, ...:
    none) and prefix decisions by outcome (``missing_tokens``: routed without token ids), summed over
    the other labels, as ``{"input:render": n, "decision:prefix_hit": m, ...}``."""
    counts: dict[str, float] = {}
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        if name == "vllm_router_kv_routing_inputs_total":
            label = _label(labels, "result")
            counts[f"input:{label}"] = counts.get(f"input:{label}", 0.0) + value
        elif name == "vllm_router_prefix_routing_decisions_total":
            label = _label(labels, "outcome")
            counts[f"decision:{label}"] = counts.get(f"decision:{label}", 0.0) + value
    return counts


def _label(labels: str, name: str) -> str:
    match = re.search(rf'(?:^|,){name}="([^"]*)"', labels)
    return match.group(1) if match else ""


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$", re.M)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# How much of a stopped router's log is kept for log_tail() once its file is removed.
_KEPT_LOG_CHARS = 256 * 1024
