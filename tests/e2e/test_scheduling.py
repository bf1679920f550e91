"""Scheduling end to end: a real Envoy, the picker (scraping real /metrics pages) and simulated vLLM pods.

Each test loads pods directly (not through Envoy), waits until the picker's scrapes show it, then sends
requests through Envoy and reads which pod served each from the simulator's ``x-sim-pod`` header.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from epp.framework import Endpoint
from epp.server.server import EndpointPicker
from epp.sim import EngineConfig, SimulatedPool
from epp.testing.envoy import EnvoyProcess
from tests.e2e.conftest import SimPicker, start_sim_picker

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "config"


@dataclass
class Stack:
    parts: SimPicker
    session: aiohttp.ClientSession

    @property
    def pool(self) -> SimulatedPool:
        return self.parts.pool

    @property
    def picker(self) -> EndpointPicker:
        return self.parts.picker

    @property
    def envoy(self) -> EnvoyProcess:
        return self.parts.envoy

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listen_port}"

    def endpoint(self, pod: int) -> Endpoint:
        found = self.picker.datastore.get(f"127.0.0.1:{self.pool[pod].port}")
        assert found is not None
        return found

    async def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting until {what}")
            await asyncio.sleep(0.02)

    async def complete(self, prompt: str, *, model: str = MODEL, max_tokens: int = 4, direct: int | None = None) -> str:
        """Send a completion (through Envoy, or straight to pod ``direct``); the serving pod's name."""
        url = self.pool.url(direct) if direct is not None else self.url
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        async with self.session.post(url + "/v1/completions", data=json.dumps(body), headers={"content-type": "application/json"}) as response:
            text = await response.text()
            assert response.status == 200, text
            return response.headers["x-sim-pod"]


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    made: list[Stack] = []

    async def make(configs: Sequence[EngineConfig], config_text: str | None = None) -> Stack:
        parts = await start_sim_picker(configs, config_text)
        stack = Stack(parts, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)))
        made.append(stack)
        return stack

    yield make
    for stack in made:
        await stack.session.close()
        await stack.parts.stop()


def _background(stack: Stack, pod: int, count: int, prompt_chars: int = 40, max_tokens: int = 2000) -> list[asyncio.Task[str]]:
    """``count`` long requests straight to ``pod`` (bypassing the picker): load it sees only by scraping."""
    return [
        asyncio.ensure_future(stack.complete(f"background {i} " + "x" * prompt_chars, max_tokens=max_tokens, direct=pod))
        for i in range(count)
    ]


async def _cancel(tasks: list[asyncio.Task[str]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# A slow engine (every step takes 10x longer) keeps background requests running for the whole test.
SLOW = EngineConfig(max_num_seqs=2, seed=1, time_scale=1.0, step_base_s=0.02)


async def test_a_pod_with_a_long_queue_is_avoided(make_stack: StackFactory) -> None:
    stack = await make_stack([SLOW] * 3)  # the default profile: queue 2, kv 2, prefix 3
    busy = _background(stack, 0, 8)  # 2 running, 6 waiting on pod-0
    try:
        await stack.wait_until(lambda: stack.endpoint(0).metrics.waiting_queue_size >= 4, "pod-0's queue is scraped")
        served = [await stack.complete(f"question {i}") for i in range(12)]
        assert "pod-0" not in served, served
    finally:
        await _cancel(busy)


async def test_a_pod_with_a_full_kv_cache_is_avoided(make_stack: StackFactory) -> None:
    small = EngineConfig(max_num_seqs=8, num_gpu_blocks=320, max_model_len=4096, seed=1, step_base_s=0.02)
    config = (CONFIGS / "kv-cache-only.yaml").read_text()
    stack = await make_stack([small] * 3, config)
    busy = _background(stack, 1, 3, prompt_chars=6000)  # ~1500 tokens each: ~90% of 5120 cached tokens
    try:
        await stack.wait_until(lambda: stack.endpoint(1).metrics.kv_cache_usage > 0.6, "pod-1's KV usage is scraped")
        served = [await stack.complete(f"short {i}") for i in range(12)]
        assert "pod-1" not in served, served
    finally:
        await _cancel(busy)


async def test_a_lora_request_goes_to_the_pod_that_has_the_adapter_loaded(make_stack: StackFactory) -> None:
    lora = EngineConfig(lora_adapters=("sql-lora", "chat-lora"), max_loras=1, seed=1, step_base_s=0.02)
    stack = await make_stack([lora] * 3, (CONFIGS / "lora-affinity.yaml").read_text())
    # pod-2 runs sql-lora; pod-0 fills its only adapter slot with another one.
    busy = [
        asyncio.ensure_future(stack.complete("warm", model="chat-lora", max_tokens=2000, direct=0)),
        asyncio.ensure_future(stack.complete("warm", model="sql-lora", max_tokens=2000, direct=2)),
    ]
    try:
        await stack.wait_until(
            lambda: "sql-lora" in stack.endpoint(2).metrics.running_adapters
            and "chat-lora" in stack.endpoint(0).metrics.running_adapters,
            "the adapters are scraped",
        )
        served = [await stack.complete(f"select {i}", model="sql-lora") for i in range(8)]
        assert set(served) == {"pod-2"}, served
    finally:
        await _cancel(busy)


async def test_a_burst_spreads_over_equal_pods_instead_of_herding(make_stack: StackFactory) -> None:
    stack = await make_stack([EngineConfig(seed=1, time_scale=0.5)] * 4)
    # Pods 1-3 each hold one long request, so at the last scrape pod-0 looks a little better (a few
    # KV blocks freer) than the rest. A metrics-only router sends the whole burst there until the
    # next scrape; in-flight accounting counts each request it sent, and the burst spreads.
    busy = [t for pod in (1, 2, 3) for t in _background(stack, pod, 1, prompt_chars=2000, max_tokens=4000)]
    try:
        await stack.wait_until(
            lambda: all(stack.endpoint(pod).metrics.kv_cache_usage > 0 for pod in (1, 2, 3)), "the background load is scraped"
        )
        served = await asyncio.gather(*(stack.complete(f"burst request {i} " * 8, max_tokens=8) for i in range(50)))
    finally:
        await _cancel(busy)
    counts = Counter(served)
    assert len(counts) == 4 and max(counts.values()) <= 20, counts


async def test_the_upstream_default_config_file_loads_unchanged(make_stack: StackFactory) -> None:
    text = (CONFIGS / "default-plugins.yaml").read_text()
    stack = await make_stack([SLOW] * 2, text)
    profile = stack.picker.scheduler.profile
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [
        ("queue-scorer", 2.0), ("kv-cache-utilization-scorer", 2.0), ("prefix-cache-scorer", 3.0)
    ]
    # The prefix scorer sends a repeated long prompt back to the pod that has it.
    prompt = "You are a helpful assistant. " * 40
    first = await stack.complete(prompt + "one")
    assert [await stack.complete(prompt + f"next {i}") for i in range(6)] == [first] * 6


async def test_a_config_with_filters_weights_and_another_picker_changes_routing(make_stack: StackFactory) -> None:
    stack = await make_stack([SLOW] * 3, (CONFIGS / "filters-and-weights.yaml").read_text())
    profile = stack.picker.scheduler.profile
    assert [f.name for f in profile.filters] == ["low-queue-filter"]
    assert type(profile.picker).__name__ == "WeightedRandomPicker"
    busy = _background(stack, 2, 6)  # 4 waiting: over the filter's threshold of 1
    try:
        await stack.wait_until(lambda: stack.endpoint(2).metrics.waiting_queue_size >= 3, "pod-2's queue is scraped")
        served = [await stack.complete(f"filtered {i}") for i in range(12)]
        assert "pod-2" not in served and set(served) == {"pod-0", "pod-1"}, served  # random between the two left
    finally:
        await _cancel(busy)
