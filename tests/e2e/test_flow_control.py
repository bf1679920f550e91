"""Admission and flow control end to end: a real Envoy, the picker in-process, simulated vLLM pods.

Each test saturates a small pool on purpose and asserts on outcomes and order, never on speed:
which requests were served, refused (429) or expired (503) with which dropped-reason header, in
which order the picker scheduled them, and that the queue holds nothing afterwards. Most tests use
``concurrency-detector`` so that what saturates the pool is exactly what the test sent; the
scale-from-zero test uses the default ``utilization-detector`` and the scraper, as in production.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from epp.framework import Endpoint, InferenceRequest, SchedulingResult
from epp.server.server import EndpointPicker
from epp.sim import EngineConfig, SimulatedPool
from epp.testing.envoy import EnvoyProcess
from tests.e2e.conftest import SimPicker, start_sim_picker

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
DROPPED = "x-llm-d-request-dropped-reason"
# Every engine step takes >= 20 ms (real time): a request of n tokens takes about n x 20 ms.
SLOW = EngineConfig(max_num_seqs=4, seed=1, step_base_s=0.02)

_HEAD = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
inferenceObjectives:
- name: interactive
  priority: 10
- name: batch
  priority: -1
"""


def concurrency_config(max_concurrency: int, flow_control: str) -> str:
    """Flow control on, saturation = the picker's in-flight requests over ``max_concurrency`` per pod."""
    return _HEAD + f"""
plugins:
- type: concurrency-detector
  parameters: {{maxConcurrency: {max_concurrency}}}
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
flowControl:
  saturationDetector: {{pluginRef: concurrency-detector}}
{flow_control}
"""


class Recorder:
    """Wraps the scheduler and remembers, in order, which objective and flow each scheduled request had."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.scheduled: list[tuple[str, str]] = []

    def run(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> SchedulingResult:
        self.scheduled.append((request.objective, request.headers.get("x-gateway-inference-fairness-id", "")))
        return self.inner.run(request, candidates)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: str


@dataclass
class Stack:
    parts: SimPicker
    session: aiohttp.ClientSession
    recorder: Recorder
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

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

    @property
    def queued(self) -> int:
        return self.picker.admission.queued  # type: ignore[union-attr]

    def sample(self, name: str, **labels: str) -> float:
        return self.picker.metrics.registry.get_sample_value(name, {"inference_pool": "static", **labels}) or 0.0

    async def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
        """A bounded wait for a state the system must reach (on a loaded machine it only takes longer)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting until {what}")
            await asyncio.sleep(0.01)

    async def post(self, tokens: int = 4, *, prompt: str = "hello", objective: str = "", flow: str = "", timeout: float = 60.0) -> Answer:
        headers = {"content-type": "application/json"}
        if objective:
            headers["x-gateway-inference-objective"] = objective
        if flow:
            headers["x-gateway-inference-fairness-id"] = flow
        body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
        async with self.session.post(
            self.url + "/v1/completions", data=json.dumps(body), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            return Answer(response.status, dict(response.headers), await response.text())

    def send(self, *args: Any, **kwargs: Any) -> asyncio.Task[Answer]:
        task = asyncio.ensure_future(self.post(*args, **kwargs))
        self.tasks.append(task)
        return task

    def add_pod(self, index: int) -> None:
        port = self.pool[index].port
        self.picker.datastore.upsert(Endpoint(f"127.0.0.1:{port}", "127.0.0.1", port))


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    made: list[Stack] = []

    async def make(configs: Sequence[EngineConfig], config_text: str, *, pods_in_pool: int | None = None) -> Stack:
        recorders: list[Recorder] = []

        def record(picker: EndpointPicker) -> None:
            recorders.append(Recorder(picker.scheduler))
            picker.director.scheduler = recorders[0]  # type: ignore[assignment]

        # With flow control an empty pool is ready too: the start returns for pods_in_pool=0.
        parts = await start_sim_picker(configs, config_text, members=pods_in_pool, before_start=record)
        stack = Stack(parts, aiohttp.ClientSession(), recorders[0])
        made.append(stack)
        return stack

    yield make
    for stack in made:
        for task in stack.tasks:
            task.cancel()
        await asyncio.gather(*stack.tasks, return_exceptions=True)
        await stack.session.close()
        await stack.parts.stop()


async def test_a_burst_over_capacity_serves_interactive_first_and_sheds_batch(make_stack: StackFactory) -> None:
    # Two pods, 2 in flight each: 4 requests saturate the pool. Batch may queue 12 deep and wait 1.3 s.
    config = concurrency_config(2, "  defaultRequestTTL: 1300ms\n  priorityBands:\n  - priority: -1\n    maxRequests: 12")
    stack = await make_stack([SLOW] * 2, config)
    batch = [stack.send(16, prompt=f"batch {i}", objective="batch") for i in range(24)]  # ~0.4 s each
    await stack.wait_until(lambda: len(stack.recorder.scheduled) == 4 and stack.queued == 12, "4 batch run and 12 queue")
    interactive = [stack.send(16, prompt=f"chat {i}", objective="interactive") for i in range(4)]
    await stack.wait_until(lambda: stack.queued == 16, "the interactive requests queue too")
    answers = await asyncio.gather(*interactive)
    assert [a.status for a in answers] == [200] * 4  # none shed
    # Strict priority: the first four scheduled after the pool saturated were the interactive ones,
    # although twelve batch requests had queued before them.
    assert [objective for objective, _ in stack.recorder.scheduled[4:8]] == ["interactive"] * 4
    outcomes = [(a.status, a.headers.get(DROPPED)) for a in await asyncio.gather(*batch)]
    assert outcomes.count((429, "rejected-saturated")) == 8  # over the band's 12: refused at once
    expired = outcomes.count((503, "rejected-ttl-expired"))  # queued, then shed: waited the whole TTL
    served = outcomes.count((200, None))
    assert expired >= 1 and served >= 4 and served + expired == 16, outcomes
    assert stack.queued == 0
    assert stack.sample("inference_extension_flow_control_queue_size", priority="-1") == 0
    assert stack.sample("llm_d_epp_flow_control_requests_total", outcome="RejectedCapacity", priority="-1") == 8
    assert stack.sample("llm_d_epp_flow_control_requests_total", outcome="EvictedTTL", priority="-1") == expired


@pytest.mark.parametrize(
    ("policy", "served_first"),
    [
        # Round robin: two backlogged flows take turns, whatever their arrival rates.
        ("round-robin-fairness-policy", ["heavy", "light"] * 3 + ["heavy"] * 6),
        # Global strict: first come, first served across flows (the heavy flow arrived first).
        ("global-strict-fairness-policy", ["heavy"] * 9 + ["light"] * 3),
    ],
)
async def test_two_flows_of_different_rates_get_equal_service(make_stack: StackFactory, policy: str, served_first: list[str]) -> None:
    config = concurrency_config(1, f"  priorityBands:\n  - priority: 0\n    fairnessPolicyRef: {policy}")
    stack = await make_stack([SLOW], config)
    blocker = stack.send(10)  # one in flight saturates the pool: everything after queues
    await stack.wait_until(lambda: len(stack.recorder.scheduled) == 1, "the first request runs")
    heavy = [stack.send(3, prompt=f"heavy {i}", flow="heavy") for i in range(9)]  # three times the other's rate
    await stack.wait_until(lambda: stack.queued == 9, "the heavy flow queues")
    light = [stack.send(3, prompt=f"light {i}", flow="light") for i in range(3)]
    await stack.wait_until(lambda: stack.queued == 12, "the light flow queues")
    answers = await asyncio.gather(blocker, *heavy, *light)
    assert all(a.status == 200 for a in answers)
    assert [flow for _, flow in stack.recorder.scheduled[1:]] == served_first
    assert stack.picker.admission.flows(0) == {}  # type: ignore[union-attr]  # no flow left behind


async def test_a_request_that_outwaits_its_ttl_gets_503_ttl_expired(make_stack: StackFactory) -> None:
    stack = await make_stack([SLOW], concurrency_config(1, "  defaultRequestTTL: 300ms"))
    blocker = stack.send(50)  # ~1 s
    await stack.wait_until(lambda: len(stack.recorder.scheduled) == 1, "the first request runs")
    late = await stack.post(4)
    assert late.status == 503 and late.headers.get(DROPPED) == "rejected-ttl-expired"
    error = json.loads(late.body)["error"]
    assert error["type"] == "service_unavailable" and "saturated" in error["message"]
    assert (await blocker).status == 200
    assert stack.queued == 0 and len(stack.recorder.scheduled) == 1  # the expired one never reached a pod


async def test_a_client_that_disconnects_while_queued_leaves_no_entry(make_stack: StackFactory) -> None:
    stack = await make_stack([SLOW], concurrency_config(1, "  defaultRequestTTL: 60s"))
    blocker = stack.send(150)  # ~3 s: the queued request cannot be dispatched meanwhile
    await stack.wait_until(lambda: len(stack.recorder.scheduled) == 1, "the first request runs")
    impatient = stack.send(4, timeout=0.5)  # the client gives up (closes its connection) after 0.5 s
    await stack.wait_until(lambda: stack.queued == 1, "the second request queues")
    with pytest.raises(asyncio.TimeoutError):
        await impatient
    # Envoy resets the ext_proc stream; the picker drops the entry at once, not at dispatch.
    await stack.wait_until(lambda: stack.queued == 0, "the entry leaves the queue")
    assert not blocker.done()
    assert stack.sample("inference_extension_flow_control_queue_size", priority="0") == 0
    assert stack.sample("inference_extension_flow_control_queue_bytes", priority="0") == 0
    assert stack.sample("llm_d_epp_flow_control_requests_total", outcome="EvictedContextCancelled", priority="0") == 1
    assert stack.picker.admission.flows(0) == {}  # type: ignore[union-attr]
    assert (await blocker).status == 200
    assert len(stack.recorder.scheduled) == 1  # the abandoned request never reached a pod


async def test_scale_from_zero_requests_wait_for_a_pod_then_succeed(make_stack: StackFactory) -> None:
    # The default utilization-detector: the new pod is dispatched to once the scraper has read it.
    config = _HEAD + "flowControl: {noEndpointRequestTTL: 30s}\n"
    stack = await make_stack([SLOW], config, pods_in_pool=0)
    waiting = [stack.send(4, prompt=f"cold {i}") for i in range(3)]
    await stack.wait_until(lambda: stack.queued == 3, "the requests wait in the picker")
    assert not any(task.done() for task in waiting) and stack.recorder.scheduled == []
    stack.add_pod(0)  # the pool scales up
    answers = await asyncio.gather(*waiting)
    assert [a.status for a in answers] == [200] * 3
    assert {a.headers["x-sim-pod"] for a in answers} == {"pod-0"}
    assert stack.queued == 0


async def test_a_prompt_larger_than_every_kv_cache_is_413(make_stack: StackFactory) -> None:
    small = EngineConfig(max_num_seqs=4, num_gpu_blocks=320, max_model_len=4096, seed=1)  # 5120 tokens of KV-cache
    stack = await make_stack([small] * 2, concurrency_config(4, ""))
    too_large = await stack.post(4, prompt="x" * 24_000)  # ~6000 tokens
    assert too_large.status == 413 and too_large.headers.get(DROPPED) is None
    error = json.loads(too_large.body)["error"]
    assert error["type"] == "invalid_request_error" and "the largest holds 5120 tokens" in error["message"]
    assert (await stack.post(4, prompt="x" * 8_000)).status == 200  # ~2000 tokens fit
    assert len(stack.recorder.scheduled) == 1
