"""The simulator's test-only switches (epp.sim.faults): a metrics page broken on demand, a record of requests."""

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from epp.sim import EngineConfig, SimulatedPod, SimulatedPool

FAST = EngineConfig(time_scale=0.05, lora_adapters=("sql-lora",))


async def _get(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> tuple[int, str, bytes]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.read()


async def test_switches_are_off_unless_asked_for() -> None:
    async with SimulatedPool(1, FAST) as pool, aiohttp.ClientSession() as session:
        async with session.put(pool.url(0) + "/sim/faults/metrics", data="html") as response:
            assert response.status in (404, 405)
        status, _, page = await _get(session, pool.url(0) + "/metrics")
        assert status == 200 and b"vllm:num_requests_waiting" in page


@pytest.mark.parametrize("path", ["/metrics", "/metrics/?name[]=vllm:num_requests_waiting"])
async def test_each_mode_breaks_both_metrics_paths_and_ok_restores_them(path: str) -> None:
    pod = SimulatedPod(FAST, fault_control=True)
    await pod.start()
    try:
        async with aiohttp.ClientSession() as session:
            control = pod.url + "/sim/faults/metrics"

            async def mode(name: str) -> None:
                async with session.put(control, data=name) as response:
                    assert response.status == 200, await response.text()

            await mode("html")
            status, kind, page = await _get(session, pod.url + path)
            assert (status, kind) == (200, "text/html") and b"<html>" in page
            await mode("garbage")
            status, _, page = await _get(session, pod.url + path)
            assert status == 200 and b"vllm:num_requests_waiting{" not in page and b"\x00" in page
            await mode("500")
            assert (await _get(session, pod.url + path))[0] == 500
            await mode("hang")
            with pytest.raises(TimeoutError):
                await _get(session, pod.url + path, timeout=0.3)
            # The pod itself still serves while its telemetry is broken.
            async with session.post(pod.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as response:
                assert response.status == 200
            async with session.get(control) as response:
                assert (await response.text()).strip() == "hang"
            await mode("ok")
            status, _, page = await _get(session, pod.url + path)
            assert status == 200 and b"vllm:num_requests_waiting" in page
            async with session.put(control, data="teapot") as response:
                assert response.status == 400 and "unknown metrics mode" in await response.text()
    finally:
        await pod.stop()


async def test_every_client_request_is_recorded_when_received_with_its_id_and_model(tmp_path: Path) -> None:
    record = tmp_path / "received.jsonl"
    async with (
        SimulatedPool(2, FAST, names=["a", "b"], record=str(record)) as pool,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(pool.url(0) + "/v1/completions", headers={"x-request-id": "r1"},
                                json={"model": "sql-lora", "prompt": "hi", "max_tokens": 2}) as response:
            assert response.status == 200
        async with session.post(pool.url(1) + "/v1/completions", headers={"x-request-id": "r2"},
                                json={"model": "nope", "prompt": "hi"}) as response:
            assert response.status == 404  # recorded all the same: the pod received it
        async with session.post(pool.url(1) + "/v1/completions", data=b"{not json") as response:
            assert response.status == 400
        # Not recorded: what the picker asks (scrapes, health, the model poller's list).
        await _get(session, pool.url(0) + "/metrics")
        await _get(session, pool.url(0) + "/health")
        async with session.get(pool.url(0) + "/v1/models", headers={"User-Agent": "epp-model-poller"}) as response:
            assert response.status == 200
        # A request still being generated is already on record.
        async def slow() -> None:
            async with session.post(pool.url(0) + "/v1/completions", headers={"x-request-id": "r4"},
                                    json={"prompt": "hi", "max_tokens": 4000, "ignore_eos": True}) as response:
                await response.read()

        task = asyncio.create_task(slow())
        for _ in range(250):
            if b'"r4"' in record.read_bytes():
                break
            await asyncio.sleep(0.02)
        assert not task.done()
        task.cancel()
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(r["pod"], r["id"], r["path"], r["model"]) for r in rows] == [
        ("a", "r1", "/v1/completions", "sql-lora"),
        ("b", "r2", "/v1/completions", "nope"),
        ("b", None, "/v1/completions", None),
        ("a", "r4", "/v1/completions", None),  # the body names no model
    ]
