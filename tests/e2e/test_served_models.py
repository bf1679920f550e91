"""Served-model awareness through a real Envoy: simulated vLLM pods, one of them serving a LoRA adapter.

The picker polls each pod's /v1/models: adapter requests never reach a pod without the adapter
(which would answer 404), base-model requests still spread over every pod, and GET /v1/models
through the gateway answers the union of the pool's lists.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp

from epp.sim import EngineConfig
from tests.e2e.conftest import RecordingScheduler, SimPicker, start_sim_picker

BASE = "meta-llama/Llama-3.1-8B-Instruct"
FAST = EngineConfig(step_base_s=0.002, seed=1)
WITH_ADAPTER = EngineConfig(lora_adapters=("sql-lora",), step_base_s=0.002, seed=2)


async def _stack(config_text: str | None = None) -> tuple[SimPicker, RecordingScheduler]:
    recorders: list[RecordingScheduler] = []

    def record(picker: object) -> None:
        recorder = RecordingScheduler(picker.director.scheduler)  # type: ignore[attr-defined]
        picker.director.scheduler = recorder  # type: ignore[attr-defined]
        recorders.append(recorder)

    stack = await start_sim_picker([WITH_ADAPTER, FAST, FAST], config_text, before_start=record)
    deadline = time.monotonic() + 15.0
    while not all(e.served.listed for e in stack.picker.datastore.endpoints()):
        assert time.monotonic() < deadline, "timed out waiting for every pod's model list"
        await asyncio.sleep(0.02)
    return stack, recorders[0]


async def send(
    stack: SimPicker, recorder: RecordingScheduler, model: str, count: int
) -> tuple[Counter[int], Counter[str]]:
    """``count`` completions for ``model`` through Envoy, 3 at a time: (statuses, picks by endpoint)."""
    url = f"http://127.0.0.1:{stack.envoy.listen_port}/v1/completions"
    statuses: Counter[int] = Counter()
    before = set(recorder.picks)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"request {i} " * 20, "max_tokens": 4}
            async with session.post(url, json=body) as response:
                await response.read()
                statuses[response.status] += 1

        for start in range(0, count, 3):
            await asyncio.gather(*(one(i) for i in range(start, min(start + 3, count))))
    picks = Counter(recorder.picks[key][0].port for key in set(recorder.picks) - before)
    ports = stack.pool.ports
    return statuses, Counter({f"pod-{ports.index(port)}": n for port, n in picks.items()})


async def test_adapter_requests_stay_on_the_adapters_pod_and_base_requests_spread() -> None:
    stack, recorder = await _stack()
    try:
        statuses, picks = await send(stack, recorder, "sql-lora", 12)
        assert statuses == {200: 12} and picks == {"pod-0": 12}  # 0 of 12 reach a pod without it
        statuses, picks = await send(stack, recorder, BASE, 24)
        assert statuses == {200: 24}
        assert len(picks) == 3, picks  # the base model is not an adapter: no pull toward the LoRA pod
        assert stack.picker.director.base_models == {BASE}
    finally:
        await stack.stop()


async def test_get_v1_models_answers_the_union() -> None:
    stack, _ = await _stack()
    try:
        url = f"http://127.0.0.1:{stack.envoy.listen_port}/v1/models"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            body = await response.json()
        assert body["object"] == "list"
        cards = {card["id"]: card for card in body["data"]}
        assert sorted(cards) == [BASE, "sql-lora"]  # deduplicated over the three pods
        assert cards["sql-lora"]["parent"] == BASE and cards[BASE]["parent"] is None
    finally:
        await stack.stop()
