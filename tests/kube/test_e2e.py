"""End to end: pods that appear in the (fake) Kubernetes API get traffic through a real Envoy, pods
that leave stop getting it, and no request is lost on the way.

The simulated vLLM pods listen on distinct loopback addresses (127.0.1.x) with one port, as pods
with their own IPs and the InferencePool's one target port; the picker discovers them through the
real client library, and Envoy's ORIGINAL_DST cluster dials whatever the picker answers.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from grpc_health.v1 import health_pb2

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.server.server import EndpointPicker
from epp.sim import EngineConfig
from epp.sim.pool import SimulatedPod
from epp.testing.envoy import EnvoyProcess, free_port
from epp.testing.fake_apiserver import PODS, FakeApiServer, make_pod, make_pool
from epp.testing.harness import PickerProcess, wait_for_picker
from tests.conftest import eventually
from tests.pickers import loopback_settings

NS = "default"
POOL = "sim-pool"
APP = {"app": "sim"}
MODEL = EngineConfig().model
RANDOM_PICKER = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: random-picker}]
"""


async def start_pods(count: int) -> tuple[int, list[SimulatedPod]]:
    """``count`` simulated pods on 127.0.1.1, 127.0.1.2, ... sharing one port (retried if taken)."""
    for _ in range(5):
        port = free_port()
        pods: list[SimulatedPod] = []
        try:
            for i in range(count):
                pod = SimulatedPod(EngineConfig(), name=f"sim-{i}", host=f"127.0.1.{i + 1}", port=port)
                await pod.start()
                pods.append(pod)
            return port, pods
        except OSError as exc:
            for pod in pods:
                await pod.stop()
            if exc.errno != errno.EADDRINUSE:
                raise
    raise RuntimeError("no common free port for the simulated pods")


@dataclass
class Load:
    """Closed-loop clients sending small completions through Envoy until stopped (bounded)."""

    url: str
    workers: int = 4
    max_requests: int = 5000  # a safety bound: the test stops the load itself
    results: list[tuple[float, int, str]] = field(default_factory=list)  # (start, status, pod)
    in_flight: dict[int, float] = field(default_factory=dict)  # request number -> start
    errors: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            await asyncio.gather(*(self._worker(session) for _ in range(self.workers)))

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set() and len(self.results) + len(self.errors) < self.max_requests:
            number = next(self._ids)
            start = time.monotonic()
            self.in_flight[number] = start
            body = json.dumps({"model": MODEL, "prompt": f"request {number}", "max_tokens": 4})
            try:
                async with session.post(self.url + "/v1/completions", data=body) as response:
                    await response.read()
                    self.results.append((start, response.status, response.headers.get("x-sim-pod", "")))
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                del self.in_flight[number]

    def stop(self) -> None:
        self._stop.set()

    def served_by(self, pod: str) -> int:
        return sum(1 for _, _, name in self.results if name == pod)


@pytest.fixture
async def pods() -> AsyncIterator[tuple[int, list[SimulatedPod]]]:
    port, started = await start_pods(3)
    yield port, started
    for pod in started:
        await pod.stop()


async def test_discovered_pods_get_traffic_and_deleted_ones_stop_without_losing_a_request(
    api: FakeApiServer, kubeconfig: Path, pods: tuple[int, list[SimulatedPod]]
) -> None:
    port, (sim0, sim1, sim2) = pods
    api.apply(make_pool(POOL, APP, [port]))
    api.apply(make_pod("sim-0", sim0.host, labels=APP))
    api.apply(make_pod("sim-1", sim1.host, labels=APP))
    settings = loopback_settings(
        pool_name=POOL,
        pool_namespace=NS,
        kubeconfig=str(kubeconfig),
        config_text=RANDOM_PICKER,
        shutdown_grace_seconds=1.0,
        metrics_scraper_process=False,
    )
    picker = EndpointPicker(settings)
    await picker.start()
    envoy = EnvoyProcess(
        render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=picker.grpc_port)),
        concurrency=1,
    )
    load = None
    try:
        assert picker.discovery is not None
        await asyncio.wait_for(picker.discovery.wait_synced(), 10)
        await asyncio.to_thread(envoy.start)
        await asyncio.to_thread(wait_for_picker, envoy)
        load = Load(f"http://127.0.0.1:{envoy.listen_port}")
        running = asyncio.create_task(load.run())

        await eventually(lambda: load.served_by("sim-0") and load.served_by("sim-1"), "traffic to sim-0 and sim-1")
        assert load.served_by("sim-2") == 0

        # A new pod: not ready at first (no traffic), then ready (traffic).
        api.apply(make_pod("sim-2", sim2.host, labels=APP, ready=False))
        served_before = len(load.results)
        await eventually(lambda: len(load.results) > served_before + 20, "requests while sim-2 is not ready")
        assert load.served_by("sim-2") == 0
        api.set_ready(NS, "sim-2", True)
        await eventually(lambda: load.served_by("sim-2") >= 3, "traffic to sim-2 once ready")

        # sim-0 terminates: it leaves the pool first, finishes what it has, then goes away.
        api.terminate(NS, "sim-0")
        await eventually(lambda: picker.datastore.get("sim-0-rank-0") is None, "sim-0 leaving the pool")
        removed_at = time.monotonic()
        await eventually(lambda: all(start > removed_at for start in load.in_flight.values()), "sim-0's last requests")
        await sim0.stop()
        api.delete(PODS, NS, "sim-0")
        served_before = len(load.results)
        await eventually(lambda: len(load.results) > served_before + 30, "requests after sim-0 is gone")
        load.stop()
        await asyncio.wait_for(running, 30)
    finally:
        if load is not None:
            load.stop()
        await asyncio.to_thread(envoy.stop)
        await picker.stop(0)

    assert load.errors == []
    assert [status for _, status, _ in load.results if status != 200] == []  # no request lost
    late_to_sim0 = [start for start, _, pod in load.results if pod == "sim-0" and start > removed_at]
    assert late_to_sim0 == []  # nothing picked sim-0 after it left the pool
    assert load.served_by("sim-1") and load.served_by("sim-2") >= 3


async def test_the_cli_discovers_its_pool_and_readiness_follows(api: FakeApiServer, kubeconfig: Path) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("vllm-0", "127.0.1.1", labels=APP))
    chart_args = [
        "--pool-name", POOL,
        "--pool-namespace", NS,
        "--pool-group", "inference.networking.k8s.io",
        "--kubeconfig", str(kubeconfig),
        "--zap-encoder", "json",
        "--ha-enable-leader-election",
        "--tracing=false",
        "--scrape-metrics=false",
    ]  # fmt: skip
    picker = PickerProcess([], extra_args=chart_args)
    try:
        await asyncio.to_thread(picker.start)  # returns once readiness is SERVING: the pool was synced
        assert await asyncio.to_thread(picker.health, "inference-extension") == serving
        log = picker.log_tail(200)
        assert "first sync of InferencePool default/sim-pool: 1 endpoint(s)" in log
        assert "flag --ha-enable-leader-election is accepted for compatibility" in log
        assert "not implemented yet" not in log
        api.delete(PODS, NS, "vllm-0")
        for _ in range(250):
            if await asyncio.to_thread(picker.health, "readiness") == not_serving:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("readiness stayed SERVING with no pod left")
        picker.terminate()
        assert await asyncio.to_thread(picker.wait, 15) == 0
    finally:
        picker.stop()


async def test_the_cli_stops_on_a_missing_kubeconfig(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "epp", "serve", "--pool-name", "p", "--kubeconfig", str(tmp_path / "absent"),
         "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"kubeconfig {tmp_path / 'absent'}: no such file" in result.stderr
    assert f"invalid configuration: kubeconfig {tmp_path / 'absent'}: no such file" in result.stderr
