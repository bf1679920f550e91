"""Where a pod publishes its KV-cache events, from its container ports named as llm-d names them."""

from __future__ import annotations

from typing import Any

from epp.kube.pods import named_port, pod_endpoints
from epp.testing.fake_apiserver import make_pod


def _ports(pod: dict[str, Any], *ports: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["containers"][0].setdefault("ports", []).extend(ports)
    return pod


def test_a_container_port_named_kv_events_is_the_endpoints_publisher() -> None:
    pod = _ports(make_pod("p", "10.0.0.7"), {"name": "kv-events", "containerPort": 5557},
                 {"name": "kv-replay", "containerPort": 5558})
    (endpoint,) = pod_endpoints(pod, (8000,))
    assert (endpoint.kv_events_port, endpoint.kv_replay_port) == (5557, 5558)


def test_a_replay_port_alone_is_named_for_a_picker_that_binds() -> None:
    pod = _ports(make_pod("p", "10.0.0.7"), {"name": "kv-replay", "containerPort": 5558})
    (endpoint,) = pod_endpoints(pod, (8000,))
    assert (endpoint.kv_events_port, endpoint.kv_replay_port) == (0, 5558)


def test_a_data_parallel_rank_publishes_on_the_port_plus_its_rank() -> None:
    pod = _ports(make_pod("p", "10.0.0.7"), {"name": "kv-events", "containerPort": 5557})
    endpoints = pod_endpoints(pod, (8000, 8001))
    assert [(e.name, e.kv_events_port, e.kv_replay_port) for e in endpoints] == [
        ("p-rank-0", 5557, 0), ("p-rank-1", 5558, 0)]


def test_without_the_port_or_with_a_bad_one_nothing_is_named(caplog) -> None:
    (endpoint,) = pod_endpoints(make_pod("p"), (8000,))
    assert endpoint.kv_events_port == 0
    pod = _ports(make_pod("p"), {"name": "kv-events", "containerPort": "5557"})
    assert named_port(pod, "kv-events") == 0 and "not a port number" in caplog.text
    assert named_port({"spec": {"containers": [None, {"ports": None}]}}, "kv-events") == 0
