"""The fake API server speaks the list/watch wire protocol (checked with a bare HTTP client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from epp.testing.fake_apiserver import INFERENCE_POOLS, PODS, FakeApiServer, make_pod, make_pool
from tests.conftest import TOKEN

PODS_PATH = "/api/v1/namespaces/default/pods"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def get(http: aiohttp.ClientSession, api: FakeApiServer, path: str, **params: str) -> tuple[int, dict[str, Any]]:
    async with http.get(api.url + path, params=params) as response:
        return response.status, await response.json()


async def events(response: aiohttp.ClientResponse, count: int) -> list[dict[str, Any]]:
    """The next ``count`` watch events: one JSON object per line."""
    out = []
    while len(out) < count:
        line = await asyncio.wait_for(response.content.readline(), 5)
        assert line.endswith(b"\n"), line
        out.append(json.loads(line))
    return out


async def test_list_has_the_collection_resource_version_and_selects_by_labels_and_fields(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.apply(make_pod("a", labels={"app": "vllm", "tier": "gpu"}))
    api.apply(make_pod("b", labels={"app": "vllm"}))
    api.apply(make_pod("c", labels={"app": "other"}))
    status, body = await get(http, api, PODS_PATH)
    assert status == 200 and body["kind"] == "PodList" and body["apiVersion"] == "v1"
    assert body["metadata"]["resourceVersion"] == str(api.resource_version)
    assert [item["metadata"]["name"] for item in body["items"]] == ["a", "b", "c"]
    assert all("kind" not in item for item in body["items"])  # as the real server: items of built-in lists
    assert all(int(item["metadata"]["resourceVersion"]) <= api.resource_version for item in body["items"])
    for selector, expected in [
        ("app=vllm", ["a", "b"]),
        ("app==vllm,tier=gpu", ["a"]),
        ("app!=vllm", ["c"]),
        ("app in (other, x)", ["c"]),
        ("app notin (other)", ["a", "b"]),
        ("tier", ["a"]),
        ("!tier", ["b", "c"]),
    ]:
        _, body = await get(http, api, PODS_PATH, labelSelector=selector)
        assert [item["metadata"]["name"] for item in body["items"]] == expected, selector
    _, body = await get(http, api, PODS_PATH, fieldSelector="metadata.name=b")
    assert [item["metadata"]["name"] for item in body["items"]] == ["b"]


async def test_list_pagination(api: FakeApiServer, http: aiohttp.ClientSession) -> None:
    for name in "abcde":
        api.apply(make_pod(name))
    names, token, pages = [], "", 0
    while True:
        params = {"limit": "2", **({"continue": token} if token else {})}
        _, body = await get(http, api, PODS_PATH, **params)
        names += [item["metadata"]["name"] for item in body["items"]]
        pages += 1
        token = body["metadata"].get("continue", "")
        if not token:
            break
    assert names == list("abcde") and pages == 3


async def test_watch_streams_events_after_the_resource_version_with_selector_transitions(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.apply(make_pod("a", labels={"app": "vllm"}))
    start = api.resource_version
    api.apply(make_pod("b", labels={"app": "vllm"}))  # after start: replayed from history
    params = {"watch": "true", "resourceVersion": str(start), "labelSelector": "app=vllm"}
    async with http.get(api.url + PODS_PATH, params=params) as response:
        assert response.status == 200 and response.headers["Transfer-Encoding"] == "chunked"
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in await events(response, 1)] == [("ADDED", "b")]
        api.set_ready("default", "a", False)
        api.update(PODS, "default", "b", lambda pod: pod["metadata"]["labels"].update(app="other"))  # leaves
        api.apply(make_pod("c", labels={"app": "other"}))  # never matches: not sent
        api.update(PODS, "default", "c", lambda pod: pod["metadata"]["labels"].update(app="vllm"))  # joins
        api.delete(PODS, "default", "a")
        got = await events(response, 4)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in got] == [
        ("MODIFIED", "a"),
        ("DELETED", "b"),
        ("ADDED", "c"),
        ("DELETED", "a"),
    ]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in got]
    assert versions == sorted(versions) and versions[-1] == api.resource_version


async def test_watch_without_resource_version_starts_with_the_current_state(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.apply(make_pool("p", {"app": "vllm"}, [8000]))
    api.apply(make_pool("q", {"app": "vllm"}, [8000]))
    path = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
    async with http.get(api.url + path, params={"watch": "1", "fieldSelector": "metadata.name=q"}) as response:
        (event,) = await events(response, 1)
    assert event["type"] == "ADDED" and event["object"]["kind"] == "InferencePool"
    assert event["object"]["metadata"]["name"] == "q"


async def test_bookmarks_carry_only_the_current_resource_version(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.apply(make_pod("a"))
    params = {"watch": "true", "resourceVersion": str(api.resource_version), "allowWatchBookmarks": "true"}
    async with http.get(api.url + PODS_PATH, params=params) as response:
        api.apply(make_pod("x", namespace="elsewhere"))
        api.send_bookmarks()
        (event,) = await events(response, 1)
    assert event["type"] == "BOOKMARK"
    assert event["object"] == {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": str(api.resource_version)},
    }


async def test_too_old_resource_version_is_410_as_an_error_event_or_as_http(
    api: FakeApiServer, http: aiohttp.ClientSession
) -> None:
    api.apply(make_pod("a"))
    old = api.resource_version
    api.apply(make_pod("b"))
    api.compact()
    params = {"watch": "true", "resourceVersion": str(old)}
    async with http.get(api.url + PODS_PATH, params=params) as response:
        assert response.status == 200
        (event,) = await events(response, 1)
        assert await response.content.read() == b""  # and the stream ends
    assert event["type"] == "ERROR"
    assert event["object"]["kind"] == "Status" and event["object"]["code"] == 410
    assert event["object"]["reason"] == "Expired"
    api.gone_as_http = True
    status, body = await get(http, api, PODS_PATH, **params)
    assert status == 410 and body["code"] == 410 and body["kind"] == "Status"


async def test_timeout_seconds_ends_the_stream_cleanly(api: FakeApiServer, http: aiohttp.ClientSession) -> None:
    params = {"watch": "true", "resourceVersion": str(api.resource_version), "timeoutSeconds": "1"}
    async with http.get(api.url + PODS_PATH, params=params) as response:
        assert await asyncio.wait_for(response.content.read(), 5) == b""


async def test_dropped_watch_is_an_incomplete_chunked_stream(api: FakeApiServer, http: aiohttp.ClientSession) -> None:
    params = {"watch": "true", "resourceVersion": str(api.resource_version)}
    async with http.get(api.url + PODS_PATH, params=params) as response:
        api.apply(make_pod("a"))
        await events(response, 1)
        assert api.drop_watches() == 1
        with pytest.raises(aiohttp.ClientPayloadError):
            await asyncio.wait_for(response.content.read(), 5)


async def test_errors_are_status_objects(api: FakeApiServer, http: aiohttp.ClientSession) -> None:
    async with aiohttp.ClientSession() as anonymous, anonymous.get(api.url + PODS_PATH) as response:
        assert response.status == 401 and (await response.json())["kind"] == "Status"
    status, body = await get(http, api, PODS_PATH + "/missing")
    assert status == 404 and body["reason"] == "NotFound"
    api.set_installed(INFERENCE_POOLS, False)
    status, body = await get(http, api, "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools")
    assert status == 404
    api.forbid(PODS)
    status, body = await get(http, api, PODS_PATH)
    assert status == 403 and body["reason"] == "Forbidden"
    status, body = await get(http, api, "/api/v1/namespaces/default/pods", labelSelector="a in b")
    assert status == 403  # forbidden before the selector is even read, as RBAC runs first
