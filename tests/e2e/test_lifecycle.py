"""The picker as a process: CLI flags, /metrics, and SIGTERM draining in-flight streams."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
from grpc_health.v1 import health_pb2

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.testing.backends import start_echo_servers
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, wait_for_picker

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# What the upstream inferencepool chart passes to its picker container (plus our static pool).
CHART_ARGS = [
    "--pool-name", "vllm-llama3-8b-instruct",
    "--pool-namespace", "default",
    "--pool-group", "inference.networking.k8s.io",
    "--zap-encoder", "json",
    "--tracing=false",
    "-v", "1",
    "--ha-enable-leader-election",
]  # fmt: skip


async def test_sigterm_drains_in_flight_streams_and_exits_zero() -> None:
    backends = await start_echo_servers(2, token_interval=0.1)
    picker = PickerProcess([b.hostport for b in backends], extra_args=["--shutdown-grace-period", "10s"])
    envoy = None
    try:
        await asyncio.to_thread(picker.start)
        envoy = EnvoyProcess(
            render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=picker.grpc_port)),
            concurrency=1,
        )
        await asyncio.to_thread(envoy.start)
        await asyncio.to_thread(wait_for_picker, envoy)
        url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
        body = json.dumps({"model": "m", "prompt": "drain me", "stream": True, "max_tokens": 15}).encode()
        events = []
        async with aiohttp.ClientSession() as session, session.post(url, data=body) as response:
            assert response.status == 200
            first = await response.content.readuntil(b"\n\n")
            events.append(first)
            picker.terminate()  # mid-stream: about 1.4 s of tokens still to come
            for _ in range(50):
                if await asyncio.to_thread(picker.health, "readiness") == NOT_SERVING:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("readiness did not go NOT_SERVING after SIGTERM")
            assert await asyncio.to_thread(picker.health, "liveness") == SERVING
            async for line in response.content:
                if line.strip():
                    events.append(line)
        assert len(events) == 16  # 15 tokens and [DONE]: the stream outlived the SIGTERM
        assert events[-1].strip() == b"data: [DONE]"
        assert await asyncio.to_thread(picker.wait, 15) == 0
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()
        for backend in backends:
            await backend.stop()


async def test_upstream_chart_arguments_are_accepted_and_metrics_are_served() -> None:
    backends = await start_echo_servers(1)
    picker = PickerProcess([b.hostport for b in backends], extra_args=CHART_ARGS)
    try:
        await asyncio.to_thread(picker.start)
        log = picker.log_tail(100)
        for flag in ("pool-group", "ha-enable-leader-election"):
            assert f"flag --{flag} is accepted for compatibility" in log
        assert "flag --tracing is accepted for compatibility" not in log  # implemented (issue 16 item 6)
        assert json.loads(log.splitlines()[-1])["level"] in ("info", "warning")  # --zap-encoder json
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5).read().decode()
        )
        for name in (
            "inference_objective_request_total",
            "inference_extension_scheduler_e2e_duration_seconds",
            "inference_pool_ready_pods",
        ):
            assert name in text
        assert 'inference_pool_ready_pods{name="vllm-llama3-8b-instruct"} 1.0' in text
    finally:
        picker.stop()
        for backend in backends:
            await backend.stop()


async def test_a_pod_envoy_cannot_connect_to_is_avoided_at_once() -> None:
    # Scrapes 5 s apart: the scrape cannot notice the dead pod within the 3 s measured, so only the
    # response path's signal (Envoy's own 503 for the pick) can keep requests away from it.
    import tests.e2e.conftest as e2e
    from epp.sim import EngineConfig

    configs = [EngineConfig(time_scale=0.05, seed=i) for i in range(3)]
    parts = await e2e.start_sim_picker(configs, settings={"refresh_metrics_interval": 5.0})
    try:
        url = f"http://127.0.0.1:{parts.envoy.listen_port}/v1/completions"
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> int:
                body = {"model": EngineConfig().model, "prompt": f"request {i}", "max_tokens": 4}
                async with session.post(url, json=body) as response:
                    await response.read()
                    return response.status

            assert [await one(i) for i in range(6)] == [200] * 6
            await parts.pool[0].stop()
            statuses = []
            for i in range(28):  # 28 requests in ~3 s, one at a time
                statuses.append(await one(100 + i))
                await asyncio.sleep(0.1)
        assert statuses.count(503) <= 1, statuses  # the first request sent there, no more
        assert statuses.count(200) == len(statuses) - statuses.count(503)
    finally:
        await parts.stop()
