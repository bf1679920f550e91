"""InferencePool and Pod objects to endpoints (epp.kube.pods): readiness, ranks, active ports, labels."""

from __future__ import annotations

from typing import Any

import pytest

from epp.datalayer.engines import ENGINE_TYPE_LABEL
from epp.kube.pods import (
    PoolSpec,
    PoolSpecError,
    active_ports,
    endpoints_for,
    parse_selector,
    parse_target_ports,
    pod_endpoints,
    pod_is_ready,
    pool_spec,
)
from epp.testing.fake_apiserver import make_pod, make_pool


def _with(pod: dict[str, Any], **changes: Any) -> dict[str, Any]:
    for path, value in changes.items():
        outer, inner = path.split("__")
        pod.setdefault(outer, {})[inner] = value
    return pod


# -- readiness --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "ready"),
    [
        (make_pod("p"), True),
        (make_pod("p", ready=False), False),
        (make_pod("p", ip=None), False),  # scheduled, no IP yet
        (_with(make_pod("p"), metadata__deletionTimestamp="2025-01-01T00:00:00Z"), False),  # terminating
        (_with(make_pod("p"), status__conditions=[]), False),
        (_with(make_pod("p"), status__conditions=[{"type": "Ready", "status": "Unknown"}]), False),
        (_with(make_pod("p"), status__conditions=[{"type": "ContainersReady", "status": "True"}]), False),
        (_with(make_pod("p"), status__conditions=None), False),
        ({}, False),
    ],
)
def test_pod_is_ready(pod: dict[str, Any], ready: bool) -> None:
    assert pod_is_ready(pod) is ready


# -- endpoints --------------------------------------------------------------------------------------


def test_one_endpoint_per_target_port_named_by_rank_with_the_pod_labels() -> None:
    labels = {"app": "vllm", ENGINE_TYPE_LABEL: "sglang"}
    endpoints = pod_endpoints(make_pod("vllm-0", "10.1.2.3", labels=labels), (8000, 8001, 8002))
    assert [(e.name, e.hostport) for e in endpoints] == [
        ("vllm-0-rank-0", "10.1.2.3:8000"),
        ("vllm-0-rank-1", "10.1.2.3:8001"),
        ("vllm-0-rank-2", "10.1.2.3:8002"),
    ]
    assert all(dict(e.labels) == labels for e in endpoints)
    assert endpoints[0].labels[ENGINE_TYPE_LABEL] == "sglang"  # what picks the scraper's metric names


def test_ipv6_pod_ip_is_bracketed_in_hostport() -> None:
    (endpoint,) = pod_endpoints(make_pod("p", "fd00::0001"), (8000,))
    assert endpoint.hostport == "[fd00::1]:8000"


def test_a_pod_ip_that_is_not_an_ip_is_skipped() -> None:
    assert pod_endpoints(make_pod("p", "not-an-ip"), (8000,)) == []


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        (None, {8000, 8001, 8002}),
        ({"inference.networking.k8s.io/active-ports": "8001"}, {8001}),
        ({"inference.networking.k8s.io/active-ports": " 8000 , 8002,"}, {8000, 8002}),
        ({"llm-d.ai/active-ports": "8002"}, {8002}),
        # llm-d's key wins over the older GIE key
        ({"llm-d.ai/active-ports": "8000", "inference.networking.k8s.io/active-ports": "8001"}, {8000}),
        # numbers that are not target ports, and garbage, are ignored
        ({"inference.networking.k8s.io/active-ports": "9999,abc,8001"}, {8001}),
        ({"inference.networking.k8s.io/active-ports": ""}, set()),
    ],
)
def test_active_ports_annotation_narrows_the_ports(annotations: dict[str, str] | None, expected: set[int]) -> None:
    pod = make_pod("p", "10.0.0.1", annotations=annotations)
    assert active_ports(pod, (8000, 8001, 8002)) == expected
    # the rank stays the port's index in targetPorts, whichever ports are active
    assert {e.name for e in pod_endpoints(pod, (8000, 8001, 8002))} == {
        f"p-rank-{rank}" for rank, port in enumerate((8000, 8001, 8002)) if port in expected
    }


def test_endpoints_for_keeps_only_ready_pods_in_name_order() -> None:
    pods = [
        make_pod("b", "10.0.0.2"),
        make_pod("c", "10.0.0.3", ready=False),
        make_pod("a", "10.0.0.1"),
        _with(make_pod("d", "10.0.0.4"), metadata__deletionTimestamp="2025-01-01T00:00:00Z"),
    ]
    assert [e.name for e in endpoints_for(pods, (8000,))] == ["a-rank-0", "b-rank-0"]


# -- InferencePool v1 -------------------------------------------------------------------------------


def test_pool_spec_of_an_inference_pool_v1() -> None:
    spec = pool_spec(make_pool("p", {"app": "vllm", "tier": "gpu"}, [8000, 8001]))
    assert spec == PoolSpec(selector=(("app", "vllm"), ("tier", "gpu")), target_ports=(8000, 8001))
    assert spec.label_selector == "app=vllm,tier=gpu"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (None, "no spec"),
        ({"targetPorts": [{"number": 8000}]}, "matchLabels is missing"),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}, "matchLabels is missing or empty"),
        # the v1alpha2 shape: a bare map and targetPortNumber
        ({"selector": {"app": "vllm"}, "targetPortNumber": 8000}, "is this InferencePool v1?"),
        ({"selector": {"matchLabels": {"app": "vllm"}}}, "spec.targetPorts is missing"),
        ({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": []}, "at least one target port"),
        ({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": "8000"}]}, "not an integer"),
        ({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 70000}]}, "not in 1-65535"),
        ({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 80}, {"number": 80}]}, "unique"),
        ({"selector": {"matchLabels": {"app": "vl lm"}}, "targetPorts": [{"number": 80}]}, "not a valid label value"),
        ({"selector": {"matchLabels": {"-app": "x"}}, "targetPorts": [{"number": 80}]}, "not a valid label key"),
        (
            {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": n} for n in range(1, 10)]},
            "at most 8 target ports",
        ),
    ],
)
def test_malformed_pool_specs_say_what_is_wrong(spec: dict[str, Any] | None, message: str) -> None:
    pool: dict[str, Any] = {"metadata": {"name": "bad"}}
    if spec is not None:
        pool["spec"] = spec
    with pytest.raises(PoolSpecError, match="InferencePool bad") as info:
        pool_spec(pool)
    assert message in str(info.value)


# -- no-CRD flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("app=vllm", (("app", "vllm"),)),
        ("app=vllm,env=prod", (("app", "vllm"), ("env", "prod"))),
        ("env==prod, app=vllm", (("app", "vllm"), ("env", "prod"))),
        ("example.com/model=llama-3", (("example.com/model", "llama-3"),)),
        ("app=", (("app", ""),)),
    ],
)
def test_parse_selector(text: str, expected: tuple[tuple[str, str], ...]) -> None:
    assert parse_selector(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no key=value pair"),
        ("app", "not key=value"),
        ("app!=vllm", "only equality selectors"),
        ("app in (a,b)", "not key=value"),
        ("app=a,app=b", "given twice"),
        ("app=has space", "not a valid label value"),
    ],
)
def test_parse_selector_errors(text: str, message: str) -> None:
    with pytest.raises(PoolSpecError, match="--endpoint-selector") as info:
        parse_selector(text)
    assert message in str(info.value)


def test_parse_target_ports() -> None:
    assert parse_target_ports("8000") == (8000,)
    assert parse_target_ports("8000, 8001,8002") == (8000, 8001, 8002)  # order kept: it is the rank


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "at least one"), ("80a", "not a port number"), ("0", "not in 1-65535"), ("80,80", "unique")],
)
def test_parse_target_ports_errors(text: str, message: str) -> None:
    with pytest.raises(PoolSpecError, match="--endpoint-target-ports") as info:
        parse_target_ports(text)
    assert message in str(info.value)


def test_public_api_of_epp_kube() -> None:
    import subprocess
    import sys

    import epp.kube

    assert epp.kube.__all__ == [
        "Discovery", "KubeConfigError", "PoolSpec", "PoolSpecError", "parse_selector", "parse_target_ports",
    ]  # fmt: skip
    # the client library is imported only when discovery starts: a static pool does not pay for it
    probe = "import sys, epp.server.server, epp.kube; sys.exit('kubernetes_asyncio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=60).returncode == 0
