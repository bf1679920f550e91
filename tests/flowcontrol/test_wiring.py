"""Metrics, plugin factories and assembly: the pieces the director and config loader use."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import epp.flowcontrol
from epp.datalayer.datastore import Datastore
from epp.flowcontrol import (
    AdmissionRequest,
    FlowControlConfig,
    FlowControlError,
    FlowController,
    FlowControlMetrics,
    LegacyAdmission,
    build_admission,
    decode_admission,
    register,
)
from epp.flowcontrol.saturation import ConcurrencyDetector, UtilizationDetector, from_config
from epp.flowcontrol.wiring import PolicyPlugin
from epp.framework import Endpoint, Metrics
from epp.scheduling.registry import Registry

POOL = "pool-a"


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"inference_pool": POOL, **labels})


async def until(predicate, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


def test_the_public_api() -> None:
    assert sorted(epp.flowcontrol.__all__) == sorted(
        [
            "DEFAULT_FLOW_ID",
            "DROPPED_REASON_HEADER",
            "FAIRNESS_ID_HEADER",
            "FLOW_CONTROL_GATE",
            "Admission",
            "AdmissionConfig",
            "AdmissionRequest",
            "BandConfig",
            "DetectorChoice",
            "FlowControlConfig",
            "FlowControlError",
            "FlowControlMetrics",
            "FlowController",
            "LegacyAdmission",
            "Outcome",
            "build_admission",
            "decode_admission",
            "decode_feature_gates",
            "decode_flow_control",
            "decode_saturation_detector",
            "register",
        ]
    )
    assert epp.flowcontrol.DROPPED_REASON_HEADER == "x-llm-d-request-dropped-reason"
    assert epp.flowcontrol.FAIRNESS_ID_HEADER == "x-gateway-inference-fairness-id"


class _Timer:
    def __init__(self, when: float, callback: Any, args: tuple[Any, ...]) -> None:
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told to: TTLs expire exactly when a test says, however loaded the machine."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[_Timer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any, *args: Any) -> _Timer:
        timer = _Timer(when, callback, args)
        self._timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [t for t in self._timers if t.when <= self.now and not t.cancelled]
        self._timers = [t for t in self._timers if t not in due]
        for timer in due:
            timer.callback(*timer.args)


async def test_metrics_follow_the_queue_under_upstream_names() -> None:
    registry = CollectorRegistry()
    saturated = True
    clock = ManualClock()
    fc = FlowController(
        FlowControlConfig(default_request_ttl=0.03, max_requests=2),
        lambda: 1.5 if saturated else 0.0,
        metrics=FlowControlMetrics(registry, POOL),
        safety_interval=3600,
        clock=clock,
    )
    tasks = [asyncio.create_task(fc.admit(AdmissionRequest(priority=-1, byte_size=100))) for _ in range(2)]
    await until(lambda: fc.queued == 2)
    assert sample(registry, "inference_extension_flow_control_queue_size", priority="-1") == 2
    assert sample(registry, "inference_extension_flow_control_queue_bytes", priority="-1") == 200
    assert sample(registry, "inference_extension_flow_control_pool_saturation") == 1.5

    with pytest.raises(FlowControlError):  # over maxRequests
        await fc.admit(AdmissionRequest(priority=-1))
    clock.advance(0.03)  # both hit the 30 ms TTL
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, FlowControlError) for r in results)
    assert sample(registry, "inference_extension_flow_control_queue_size", priority="-1") == 0
    assert sample(registry, "inference_extension_flow_control_queue_bytes", priority="-1") == 0
    assert sample(registry, "llm_d_epp_flow_control_requests_total", outcome="EvictedTTL", priority="-1") == 2
    assert sample(registry, "llm_d_epp_flow_control_requests_total", outcome="RejectedCapacity", priority="-1") == 1
    histogram = "inference_extension_flow_control_request_queue_duration_seconds"
    assert sample(registry, histogram + "_count", outcome="EvictedTTL", priority="-1") == 2
    assert sample(registry, histogram + "_sum", outcome="EvictedTTL", priority="-1") >= 0.06

    saturated = False
    assert await fc.admit(AdmissionRequest(priority=3)) == 0.0
    assert sample(registry, "llm_d_epp_flow_control_requests_total", outcome="Dispatched", priority="3") == 1
    assert sample(registry, "inference_extension_flow_control_pool_saturation") == 0.0


async def test_legacy_admission_counts_its_sheds() -> None:
    registry = CollectorRegistry()
    admission = LegacyAdmission(lambda: 1.0, metrics=FlowControlMetrics(registry, POOL))
    with pytest.raises(FlowControlError):
        await admission.admit(AdmissionRequest(priority=-1))
    assert sample(registry, "llm_d_epp_flow_control_requests_total", outcome="RejectedSaturated", priority="-1") == 1


def fresh(name: str, *, queue: int = 0, kv: float = 0.0) -> Endpoint:
    address = name.split(":")[0]
    metrics = Metrics(waiting_queue_size=queue, kv_cache_usage=kv, updated_at=time.monotonic(), stale=False)
    return Endpoint(name, address, 8000, metrics=metrics)


async def test_scale_from_zero_with_the_real_detector_and_datastore() -> None:
    datastore = Datastore()
    config = decode_admission({"featureGates": ["flowControl"], "flowControl": {"noEndpointRequestTTL": "10s"}})
    detector = from_config(config.detector.type, config.detector.parameters)
    admission = build_admission(config, detector, datastore.endpoints, safety_interval=3600)
    assert isinstance(admission, FlowController) and isinstance(detector, UtilizationDetector)

    task = asyncio.create_task(admission.admit(AdmissionRequest()))
    await until(lambda: admission.queued == 1)
    for _ in range(20):
        await asyncio.sleep(0)
    assert not task.done()  # an empty pool reads as saturated: the request waits

    datastore.upsert(fresh("10.0.0.1"))  # a pod appears with fresh, idle metrics...
    admission.wake()  # ...and the director wakes the queue on the membership change
    assert await asyncio.wait_for(task, 2) >= 0.0
    assert admission.queued == 0


async def test_gate_off_builds_the_legacy_path() -> None:
    datastore = Datastore([fresh("10.0.0.1", queue=50)])  # far over the queue threshold
    config = decode_admission({})
    admission = build_admission(config, from_config(config.detector.type, config.detector.parameters), datastore.endpoints)
    assert isinstance(admission, LegacyAdmission)
    assert await admission.admit(AdmissionRequest(priority=0)) == 0.0
    with pytest.raises(FlowControlError) as excinfo:
        await admission.admit(AdmissionRequest(priority=-1))
    assert excinfo.value.status == 429


@dataclass
class FakeHandle:
    datastore: Any = None
    in_flight: Any = None


def test_plugin_types_register_and_build() -> None:
    registry = Registry()
    register(registry)
    assert set(registry.types()) == {
        "utilization-detector",
        "concurrency-detector",
        "global-strict-fairness-policy",
        "round-robin-fairness-policy",
        "fcfs-ordering-policy",
    }
    handle = FakeHandle(in_flight=lambda endpoint: (3, 0))
    detector = registry.create("concurrency-detector", "sat", {"maxConcurrency": 4}, handle)
    assert isinstance(detector, ConcurrencyDetector) and detector.name == "sat"
    assert detector.saturation([fresh("10.0.0.1")]) == 0.75
    with pytest.raises(ValueError, match="in-flight tracker"):
        registry.create("concurrency-detector", "sat", {}, FakeHandle())
    with pytest.raises(ValueError, match="unknown parameter"):
        registry.create("utilization-detector", "u", {"threshold": 1}, FakeHandle())
    policy = registry.create("round-robin-fairness-policy", "fair", {}, FakeHandle())
    assert isinstance(policy, PolicyPlugin) and policy.type_name == "round-robin-fairness-policy"
    with pytest.raises(ValueError, match="takes no parameters"):
        registry.create("fcfs-ordering-policy", "f", {"x": 1}, FakeHandle())
