"""Discovery (epp.kube) with the real client library against the fake API server, over real sockets.

Covered: the first full sync, pods becoming ready and unready, graceful and immediate deletion, a
pod relabelled out of the pool, selector and target-port changes, the active-ports annotation,
watch expiry (410 as an ERROR event and as HTTP 410), dropped watch connections, an API server
restart with and without its history, bookmarks, a pool missing or deleted, a CRD not installed,
403 and 401, the no-CRD mode, and readiness (gRPC health) waiting for the first sync.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.datalayer.datastore import Datastore
from epp.framework import Metrics
from epp.kube.discovery import Discovery
from epp.kube.pods import PoolSpec
from epp.server.server import EndpointPicker
from epp.testing.fake_apiserver import INFERENCE_POOLS, PODS, FakeApiServer, make_pod, make_pool, write_kubeconfig
from tests.conftest import eventually
from tests.pickers import loopback_settings

NS = "default"
POOL = "pool"
APP = {"app": "vllm"}

Start = Callable[..., Awaitable[Discovery]]


def names(discovery: Discovery) -> list[str]:
    return sorted(e.name for e in discovery.datastore.endpoints())


@pytest.fixture
async def discover(kubeconfig: Path) -> AsyncIterator[Start]:
    started: list[Discovery] = []

    async def start(**kwargs: Any) -> Discovery:
        if "spec" not in kwargs:
            kwargs.setdefault("pool_name", POOL)
        discovery = Discovery(Datastore(), namespace=NS, kubeconfig=str(kubeconfig), backoff=(0.02, 0.2), **kwargs)
        await discovery.start()
        started.append(discovery)
        return discovery

    yield start
    for discovery in started:
        await discovery.stop()


async def synced(start: Start, **kwargs: Any) -> Discovery:
    discovery = await start(**kwargs)
    await asyncio.wait_for(discovery.wait_synced(), 10)
    return discovery


def _pods_watch_open(api: FakeApiServer) -> Callable[[], bool]:
    return lambda: any("labelSelector" in r.query for r in api.watch_requests(PODS)) and api.open_watches >= 1


# -- the first sync -----------------------------------------------------------------------------------


async def test_first_sync_lists_the_pool_then_its_ready_pods_and_watches_from_the_list(
    api: FakeApiServer, discover: Start
) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pool("other-pool", {"app": "other"}, [9000]))
    api.apply(make_pod("ready", "10.0.0.1", labels=APP))
    api.apply(make_pod("unready", "10.0.0.2", labels=APP, ready=False))
    api.apply(make_pod("no-ip", None, labels=APP))
    api.apply(make_pod("other-app", "10.0.0.3", labels={"app": "other"}))
    api.apply(make_pod("elsewhere", "10.0.0.4", labels=APP, namespace="other-ns"))
    api.apply(make_pod("leaving", "10.0.0.5", labels=APP))
    api.terminate(NS, "leaving")
    listed_at = api.resource_version
    discovery = await synced(discover)

    assert names(discovery) == ["ready-rank-0"]
    (endpoint,) = discovery.datastore.endpoints()
    assert endpoint.hostport == "10.0.0.1:8000" and dict(endpoint.labels) == APP
    (pool_list,) = api.list_requests(INFERENCE_POOLS)
    assert pool_list.path == f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
    assert pool_list.query["fieldSelector"] == f"metadata.name={POOL}"
    (pod_list,) = api.list_requests(PODS)
    assert pod_list.path == f"/api/v1/namespaces/{NS}/pods" and pod_list.query["labelSelector"] == "app=vllm"
    await eventually(_pods_watch_open(api), "the pod watch")
    watch = api.watch_requests(PODS)[0]
    assert watch.query["resourceVersion"] == str(listed_at)  # the watch starts where the list ended
    assert watch.query["allowWatchBookmarks"] in ("true", "True")
    assert 300 <= int(watch.query["timeoutSeconds"]) <= 600


# -- pod lifecycle ------------------------------------------------------------------------------------


async def test_pods_becoming_ready_and_unready(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.apply(make_pod("b", "10.0.0.2", labels=APP, ready=False))
    discovery = await synced(discover)
    assert names(discovery) == ["a-rank-0"]
    scraped = Metrics(waiting_queue_size=7, stale=False)
    discovery.datastore.update_metrics("a-rank-0", scraped)

    api.set_ready(NS, "b", True)
    await eventually(lambda: names(discovery) == ["a-rank-0", "b-rank-0"], "b ready")
    assert discovery.datastore.get("a-rank-0").metrics is scraped  # an unchanged endpoint keeps its metrics

    api.set_ready(NS, "a", False)
    await eventually(lambda: names(discovery) == ["b-rank-0"], "a unready")
    api.set_ready(NS, "a", True)
    await eventually(lambda: names(discovery) == ["a-rank-0", "b-rank-0"], "a ready again")


async def test_a_pod_gets_its_ip_after_being_ready(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    pod = api.apply(make_pod("a", None, labels=APP))
    discovery = await synced(discover)
    assert names(discovery) == []
    pod["status"]["podIP"] = "10.0.0.9"
    api.apply(pod)
    await eventually(lambda: [e.hostport for e in discovery.datastore.endpoints()] == ["10.0.0.9:8000"], "the IP")


async def test_deletion_graceful_and_immediate(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    for i, name in enumerate("abc"):
        api.apply(make_pod(name, f"10.0.0.{i + 1}", labels=APP))
    discovery = await synced(discover)
    assert names(discovery) == ["a-rank-0", "b-rank-0", "c-rank-0"]

    api.terminate(NS, "a")  # graceful: the pod still exists, still Ready, but gets no new requests
    await eventually(lambda: names(discovery) == ["b-rank-0", "c-rank-0"], "a terminating")
    api.delete(PODS, NS, "a")
    api.delete(PODS, NS, "b")  # immediate (force) deletion
    await eventually(lambda: names(discovery) == ["c-rank-0"], "b deleted")


async def test_a_pod_relabelled_out_of_the_selector_leaves_the_pool(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.apply(make_pod("b", "10.0.0.2", labels={"app": "staging"}))
    discovery = await synced(discover)
    api.update(PODS, NS, "a", lambda pod: pod["metadata"]["labels"].update(app="staging"))
    api.update(PODS, NS, "b", lambda pod: pod["metadata"]["labels"].update(app="vllm"))
    await eventually(lambda: names(discovery) == ["b-rank-0"], "a out, b in")


async def test_label_changes_reach_the_endpoint_labels(api: FakeApiServer, discover: Start) -> None:
    engine = "inference.networking.k8s.io/engine-type"
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    discovery = await synced(discover)
    api.update(PODS, NS, "a", lambda pod: pod["metadata"]["labels"].update({engine: "sglang"}))
    await eventually(lambda: discovery.datastore.get("a-rank-0").labels.get(engine) == "sglang", "the engine label")


# -- pool changes -------------------------------------------------------------------------------------


async def test_selector_change_relists_the_pods(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("old", "10.0.0.1", labels=APP))
    api.apply(make_pod("new", "10.0.0.2", labels={"app": "vllm-v2"}))
    discovery = await synced(discover)
    assert names(discovery) == ["old-rank-0"]

    api.update(INFERENCE_POOLS, NS, POOL, lambda pool: pool["spec"]["selector"].update(matchLabels={"app": "vllm-v2"}))
    await eventually(lambda: names(discovery) == ["new-rank-0"], "the new selector's pods")
    assert [r.query["labelSelector"] for r in api.list_requests(PODS)] == ["app=vllm", "app=vllm-v2"]
    # and the new selector is watched: a pod added later arrives
    api.apply(make_pod("newer", "10.0.0.3", labels={"app": "vllm-v2"}))
    await eventually(lambda: names(discovery) == ["new-rank-0", "newer-rank-0"], "a pod added after the change")


async def test_target_port_change_recomputes_the_endpoints(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.apply(make_pod("b", "10.0.0.2", labels=APP, annotations={"inference.networking.k8s.io/active-ports": "8001"}))
    discovery = await synced(discover)
    assert names(discovery) == ["a-rank-0"]  # b serves only on 8001, not a target port yet

    api.update(
        INFERENCE_POOLS, NS, POOL, lambda pool: pool["spec"].update(targetPorts=[{"number": 8000}, {"number": 8001}])
    )
    await eventually(lambda: names(discovery) == ["a-rank-0", "a-rank-1", "b-rank-1"], "the second port")
    assert discovery.datastore.get("b-rank-1").hostport == "10.0.0.2:8001"

    api.update(INFERENCE_POOLS, NS, POOL, lambda pool: pool["spec"].update(targetPorts=[{"number": 8001}]))
    await eventually(lambda: names(discovery) == ["a-rank-0", "b-rank-0"], "8001 only, now rank 0")
    assert {e.hostport for e in discovery.datastore.endpoints()} == {"10.0.0.1:8001", "10.0.0.2:8001"}

    api.update(
        PODS,
        NS,
        "b",
        lambda pod: pod["metadata"]["annotations"].update({"inference.networking.k8s.io/active-ports": "8000"}),
    )
    await eventually(lambda: names(discovery) == ["a-rank-0"], "b's active port is no target port")
    # the pod copy already held every selected pod: ports changed without a re-list
    assert len(api.list_requests(PODS)) == 1


async def test_an_invalid_pool_update_keeps_the_previous_pool(
    api: FakeApiServer, discover: Start, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    discovery = await synced(discover)
    with caplog.at_level(logging.ERROR, logger="epp.kube"):
        api.update(INFERENCE_POOLS, NS, POOL, lambda pool: pool["spec"].update(targetPorts=[]))
        await eventually(lambda: "at least one target port" in caplog.text, "the error log")
    assert names(discovery) == ["a-rank-0"]
    assert "keeping the previous pool" in caplog.text


async def test_pool_missing_at_start_then_created_then_deleted(
    api: FakeApiServer, discover: Start, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    with caplog.at_level(logging.WARNING, logger="epp.kube"):
        discovery = await synced(discover)  # listed: it does not exist
    assert names(discovery) == [] and f"InferencePool {NS}/{POOL} does not exist" in caplog.text
    api.apply(make_pool(POOL, APP, [8000]))
    await eventually(lambda: names(discovery) == ["a-rank-0"], "the pool created")
    api.delete(INFERENCE_POOLS, NS, POOL)
    await eventually(lambda: names(discovery) == [], "the pool deleted")
    await eventually(lambda: discovery.pod_reflector is None, "the pod watch stopped")


# -- failures -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_watch_expiry_410_relists(api: FakeApiServer, discover: Start, gone_as_http: bool) -> None:
    api.gone_as_http = gone_as_http
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    discovery = await synced(discover)
    await eventually(_pods_watch_open(api), "the pod watch")

    if gone_as_http:  # the watch is cut, b added and the history compacted: resuming is answered with HTTP 410
        api.drop_watches()
        api.apply(make_pod("b", "10.0.0.2", labels=APP))
        api.compact()
    else:  # the open watch receives the ERROR event (Status code 410, reason Expired)
        assert api.expire_watches() >= 1
        api.apply(make_pod("b", "10.0.0.2", labels=APP))
    await eventually(lambda: len(api.list_requests(PODS)) == 2, "a re-list")
    await eventually(lambda: names(discovery) == ["a-rank-0", "b-rank-0"], "b, after the re-list")
    api.delete(PODS, NS, "a")  # and the watch after the re-list works
    await eventually(lambda: names(discovery) == ["b-rank-0"], "a deleted")


async def test_dropped_connections_resume_the_watch_without_a_relist(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    discovery = await synced(discover)
    for i in range(3):
        await eventually(lambda: api.open_watches == 2, "both watches open")
        version = discovery.pod_reflector.resource_version
        watches = len(api.watch_requests(PODS))
        assert api.drop_watches() == 2
        api.apply(make_pod(f"p{i}", f"10.0.1.{i}", labels=APP))
        await eventually(lambda n=i: f"p{n}-rank-0" in names(discovery), "the pod added while the watch was down")
        resumed = api.watch_requests(PODS)[watches]
        assert int(resumed.query["resourceVersion"]) >= int(version)  # resumed where it was, not from scratch
    assert len(api.list_requests(PODS)) == 1 and len(api.list_requests(INFERENCE_POOLS)) == 1


async def test_bookmarks_keep_a_quiet_watch_position_fresh(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    discovery = await synced(discover)
    for i in range(5):  # writes the pod watch does not see (another namespace)
        api.apply(make_pod(f"x{i}", "10.9.0.1", labels=APP, namespace="elsewhere"))
    await eventually(
        lambda: discovery.pod_reflector.resource_version == str(api.resource_version), "a bookmark's resourceVersion"
    )
    await api.restart(keep_history=False)  # its history is lost; the bookmark's position is still current
    api.apply(make_pod("b", "10.0.0.2", labels=APP))
    await eventually(lambda: names(discovery) == ["a-rank-0", "b-rank-0"], "b after the restart")
    assert len(api.list_requests(PODS)) == 1  # no re-list was needed


async def test_api_server_restart_while_things_change(
    api: FakeApiServer, discover: Start, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.apply(make_pod("b", "10.0.0.2", labels=APP))
    discovery = await synced(discover)
    await eventually(lambda: api.open_watches == 2, "both watches open")
    lists = len(api.list_requests(PODS))
    with caplog.at_level(logging.WARNING, logger="epp.kube"):
        await api.stop()
        api.delete(PODS, NS, "a")  # while it is down (etcd keeps the writes)
        api.apply(make_pod("c", "10.0.0.3", labels=APP))
        api.compact()  # and the restarted server's watch cache does not hold them
        await eventually(lambda: "ClientConnectorError" in caplog.text, "the client retrying")
        await api.start()
        await eventually(lambda: names(discovery) == ["b-rank-0", "c-rank-0"], "the state after the restart")
    assert len(api.list_requests(PODS)) > lists  # 410 on resume: re-listed
    assert names(discovery) == ["b-rank-0", "c-rank-0"]  # no empty pool on the way (it is only ever replaced)


async def test_crd_not_installed_then_installed(
    api: FakeApiServer, discover: Start, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.set_installed(INFERENCE_POOLS, False)
    with caplog.at_level(logging.WARNING, logger="epp.kube"):
        discovery = await discover()
        await eventually(lambda: len(api.list_requests(INFERENCE_POOLS)) >= 3, "retries with backoff")
    assert not discovery.synced and names(discovery) == []
    assert "404: the server could not find the requested resource" in caplog.text
    api.set_installed(INFERENCE_POOLS, True)
    await asyncio.wait_for(discovery.wait_synced(), 10)
    assert names(discovery) == ["a-rank-0"]


async def test_forbidden_pods_are_retried_and_logged(
    api: FakeApiServer, discover: Start, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.forbid(PODS)
    with caplog.at_level(logging.WARNING, logger="epp.kube"):
        discovery = await discover()
        await eventually(lambda: 'cannot list resource "pods"' in caplog.text, "the 403 in the log")
    assert not discovery.synced  # the pool alone is not a full sync
    api.forbid(PODS, False)
    await asyncio.wait_for(discovery.wait_synced(), 10)
    assert names(discovery) == ["a-rank-0"]


async def test_a_wrong_token_is_a_401_in_the_log(
    api: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    path = write_kubeconfig(tmp_path / "wrong", api.url, token="wrong")
    discovery = Discovery(Datastore(), namespace=NS, pool_name=POOL, kubeconfig=str(path), backoff=(0.02, 0.2))
    with caplog.at_level(logging.WARNING, logger="epp.kube"):
        await discovery.start()
        try:
            await eventually(lambda: "401: Unauthorized" in caplog.text, "the 401 in the log")
        finally:
            await discovery.stop()
    assert not discovery.synced
    assert all(r.query.get("fieldSelector") == f"metadata.name={POOL}" for r in api.requests)


# -- no-CRD mode --------------------------------------------------------------------------------------


async def test_endpoint_selector_mode_watches_pods_only(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pod("a", "10.0.0.1", labels={"app": "vllm", "env": "prod"}))
    api.apply(make_pod("b", "10.0.0.2", labels={"app": "vllm", "env": "dev"}))
    spec = PoolSpec(selector=(("app", "vllm"), ("env", "prod")), target_ports=(8000, 8001))
    discovery = await synced(discover, spec=spec)
    assert names(discovery) == ["a-rank-0", "a-rank-1"]
    assert api.list_requests(INFERENCE_POOLS) == []
    assert api.list_requests(PODS)[0].query["labelSelector"] == "app=vllm,env=prod"
    api.update(PODS, NS, "b", lambda pod: pod["metadata"]["labels"].update(env="prod"))
    await eventually(lambda: len(names(discovery)) == 4, "b joins")


# -- readiness ----------------------------------------------------------------------------------------


async def _health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return reply.status


async def test_readiness_waits_for_the_first_full_sync(api: FakeApiServer, kubeconfig: Path) -> None:
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    api.forbid(PODS)  # the pool can be read, its pods not yet
    settings = loopback_settings(
        pool_name=POOL,
        pool_namespace=NS,
        kubeconfig=str(kubeconfig),
        scrape_metrics=False,
    )
    picker = EndpointPicker(settings)
    assert picker.discovery is not None
    await picker.start()
    try:
        await eventually(lambda: len(api.list_requests(PODS)) >= 2, "the pod list failing")
        assert await _health(picker.grpc_health_port, "liveness") == SERVING
        for service in ("", "readiness", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert await _health(picker.grpc_health_port, service) == NOT_SERVING
        api.forbid(PODS, False)
        await asyncio.wait_for(picker.discovery.wait_synced(), 10)
        for service in ("readiness", "inference-extension"):
            await eventually_async(lambda s=service: _health(picker.grpc_health_port, s), SERVING)
        api.set_ready(NS, "a", False)  # no endpoint left: not ready
        await eventually_async(lambda: _health(picker.grpc_health_port, "readiness"), NOT_SERVING)
    finally:
        await picker.stop(0)


async def eventually_async(probe: Callable[[], Awaitable[int]], want: int, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (got := await probe()) != want:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"health is {got}, wanted {want}")
        await asyncio.sleep(0.02)


# -- the watch loop -----------------------------------------------------------------------------------


async def test_server_side_watch_timeouts_resume_without_a_relist(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    api.apply(make_pod("a", "10.0.0.1", labels=APP))
    discovery = await synced(discover, watch_timeout=(1, 1))  # timeoutSeconds=1: the server ends each watch
    await eventually(lambda: len(api.watch_requests(PODS)) >= 3, "watches renewed after their timeout")
    assert all(r.query["timeoutSeconds"] == "1" for r in api.watch_requests(PODS))
    api.apply(make_pod("b", "10.0.0.2", labels=APP))
    await eventually(lambda: names(discovery) == ["a-rank-0", "b-rank-0"], "b")
    assert len(api.list_requests(PODS)) == 1


async def test_large_objects_cross_network_reads(api: FakeApiServer, discover: Start) -> None:
    api.apply(make_pool(POOL, APP, [8000]))
    discovery = await synced(discover)
    big = {"example.com/blob": "x" * 600_000}  # one watch line far larger than a read (and aiohttp's line limit)
    api.apply(make_pod("a", "10.0.0.1", labels=APP, annotations=big))
    await eventually(lambda: names(discovery) == ["a-rank-0"], "the large pod")
    assert discovery.pod_reflector.objects["a"]["metadata"]["annotations"] == big
