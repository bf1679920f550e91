"""--metrics-endpoint-auth (epp.server.metrics_auth): the metrics port asks the API server, through a real picker.

The picker runs with Kubernetes discovery against the fake API server (its TokenReview and
SubjectAccessReview configured per test), and is scraped over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from epp.datalayer.static import parse_endpoints
from epp.kube.auth import Access, ReviewUnavailable
from epp.server.metrics_auth import MetricsAuth
from epp.server.server import EndpointPicker
from epp.testing.fake_apiserver import FakeApiServer, make_pool
from epp.testing.fake_reviews import SUBJECT_ACCESS_REVIEWS, TOKEN_REVIEWS
from tests.pickers import loopback_settings

PROMETHEUS = "system:serviceaccount:monitoring:prometheus"


def _get(port: int, path: str, token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


async def _scrape(port: int, path: str = "/metrics", token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    # In a thread: a cache miss waits for the event loop, which must stay free to make the review calls.
    return await asyncio.to_thread(_get, port, path, token)


@pytest.fixture
async def picker(api: FakeApiServer, kubeconfig: Path) -> AsyncIterator[EndpointPicker]:
    api.apply(make_pool("pool", {"app": "vllm"}, [8000]))
    api.reviews.tokens.update({"prom-token": PROMETHEUS, "nobody-token": "system:serviceaccount:default:nobody"})
    api.reviews.allow(PROMETHEUS, "/metrics")
    settings = loopback_settings(
        pool_name="pool",
        kubeconfig=str(kubeconfig),
        metrics_port=0,
        scrape_metrics=False,
        enable_debug_endpoints=True,
    )
    running = EndpointPicker(settings)
    await running.start()
    yield running
    await running.stop(grace=0)


async def test_a_token_the_api_server_accepts_for_a_user_allowed_to_get_metrics_is_served(
    api: FakeApiServer, picker: EndpointPicker
) -> None:
    status, _, body = await _scrape(picker.metrics_port, token="prom-token")
    assert status == 200 and b"inference_pool_ready_pods" in body
    (_, token_spec), (_, access_spec) = api.reviews.calls
    assert token_spec == {"token": "prom-token"}
    assert access_spec["user"] == PROMETHEUS and "system:authenticated" in access_spec["groups"]
    assert access_spec["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}


async def test_no_header_is_401_with_a_bearer_challenge_and_costs_no_api_call(
    api: FakeApiServer, picker: EndpointPicker
) -> None:
    status, headers, body = await _scrape(picker.metrics_port)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert b"Authorization: Bearer" in body and b"inference_" not in body
    assert api.reviews.call_count() == 0


async def test_a_token_the_api_server_rejects_is_401(api: FakeApiServer, picker: EndpointPicker) -> None:
    status, headers, body = await _scrape(picker.metrics_port, token="forged")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer") and b"TokenReview" in body
    assert api.reviews.call_count(TOKEN_REVIEWS) == 1 and api.reviews.call_count(SUBJECT_ACCESS_REVIEWS) == 0


async def test_a_user_rbac_does_not_allow_is_403(api: FakeApiServer, picker: EndpointPicker) -> None:
    status, _, body = await _scrape(picker.metrics_port, token="nobody-token")
    assert status == 403 and b"inference_" not in body
    assert api.reviews.call_count(SUBJECT_ACCESS_REVIEWS) == 1


async def test_a_second_scrape_is_answered_from_the_cache(api: FakeApiServer, picker: EndpointPicker) -> None:
    for _ in range(3):
        assert (await _scrape(picker.metrics_port, token="prom-token"))[0] == 200
        assert (await _scrape(picker.metrics_port, token="nobody-token"))[0] == 403
    assert api.reviews.call_count(TOKEN_REVIEWS) == 2 and api.reviews.call_count(SUBJECT_ACCESS_REVIEWS) == 2


async def test_the_debug_endpoints_sit_behind_the_same_check_for_their_own_path(
    api: FakeApiServer, picker: EndpointPicker
) -> None:
    assert (await _scrape(picker.metrics_port, "/debug/pool"))[0] == 401
    # Allowed /metrics is not allowed /debug/pool: the review names the path asked for, as upstream's.
    assert (await _scrape(picker.metrics_port, "/debug/pool", "prom-token"))[0] == 403
    api.reviews.allow("system:serviceaccount:default:nobody", "/debug/*")
    status, _, body = await _scrape(picker.metrics_port, "/debug/pool", "nobody-token")
    assert status == 200 and b'"endpoints"' in body
    assert api.reviews.calls[-1][1]["nonResourceAttributes"] == {"path": "/debug/pool", "verb": "get"}


async def test_an_api_server_that_refuses_the_reviews_gives_503_never_the_metrics(
    api: FakeApiServer, picker: EndpointPicker, caplog: pytest.LogCaptureFixture
) -> None:
    api.reviews.forbidden = True  # the picker's ServiceAccount may not create tokenreviews
    with caplog.at_level(logging.WARNING, "epp.server.metrics_auth"):
        for _ in range(2):
            status, _, body = await _scrape(picker.metrics_port, token="prom-token")
            assert status == 503 and b"inference_" not in body
    # not cached: each one asked; logged once
    assert api.reviews.call_count(TOKEN_REVIEWS) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "epp.server.metrics_auth"]
    assert len(warnings) == 1 and "403" in warnings[0]


async def test_an_unreachable_api_server_gives_503(api: FakeApiServer, picker: EndpointPicker) -> None:
    await api.stop()
    status, _, body = await _scrape(picker.metrics_port, token="prom-token")
    assert status == 503 and b"inference_" not in body


async def test_static_mode_has_no_api_server_so_no_auth_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    settings = loopback_settings(
        endpoints=tuple(parse_endpoints("127.0.0.1:1")),
        metrics_port=0,
        scrape_metrics=False,
    )
    assert settings.metrics_endpoint_auth  # upstream's default
    picker = EndpointPicker(settings)
    with caplog.at_level(logging.INFO):
        await picker.start()
    try:
        assert (await _scrape(picker.metrics_port))[0] == 200
        lines = [r for r in caplog.records if "metrics endpoint auth" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO and "static pool" in lines[0].getMessage()
    finally:
        await picker.stop(grace=0)


async def test_auth_turned_off_with_discovery_serves_without_a_token(api: FakeApiServer, kubeconfig: Path) -> None:
    settings = loopback_settings(
        pool_name="pool",
        kubeconfig=str(kubeconfig),
        metrics_port=0,
        scrape_metrics=False,
        metrics_endpoint_auth=False,
    )
    picker = EndpointPicker(settings)
    await picker.start()
    try:
        assert (await _scrape(picker.metrics_port))[0] == 200
        assert api.reviews.call_count() == 0
    finally:
        await picker.stop(grace=0)


# --- the cache and the thread hand-off, with a scripted review ------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _check(auth: MetricsAuth, token: str, path: str = "/metrics") -> str:
    refusal = await asyncio.to_thread(auth.refusal, f"Bearer {token}", path)
    return "ok" if refusal is None else refusal[0].split()[0]


async def test_cache_lifetimes_are_10s_allowed_and_2s_refused_and_its_size_is_bounded() -> None:
    asked: list[str] = []
    answers = {"good": Access.ALLOWED, "bad": Access.UNAUTHENTICATED}

    async def review(token: str, path: str) -> tuple[Access, str]:
        asked.append(token)
        return answers.get(token, Access.FORBIDDEN), "someone"

    clock = _Clock()
    auth = MetricsAuth(review, asyncio.get_running_loop(), clock=clock, max_entries=2)
    assert [await _check(auth, t) for t in ("good", "bad", "good", "bad")] == ["ok", "401", "ok", "401"]
    assert asked == ["good", "bad"]
    clock.now += 2.5  # refusals expire, the allowed one is still cached
    assert [await _check(auth, t) for t in ("good", "bad")] == ["ok", "401"]
    assert asked == ["good", "bad", "bad"]
    clock.now += 8.0
    assert await _check(auth, "good") == "ok" and asked[-1] == "good"
    # At most 2 entries: a third token evicts the least recently used ("bad").
    assert await _check(auth, "other") == "403"
    asked.clear()
    assert await _check(auth, "good") == "ok" and await _check(auth, "bad") == "401"
    assert asked == ["bad"]
    # the scheme is case-insensitive; anything but a bearer token is no token at all
    assert (await asyncio.to_thread(auth.refusal, "bearer good", "/metrics")) is None
    refusal = await asyncio.to_thread(auth.refusal, "Basic dXNlcjpwYXNz", "/metrics")
    assert refusal is not None and refusal[0] == "401 Unauthorized"


async def test_a_review_slower_than_the_timeout_is_503_and_not_cached() -> None:
    release = asyncio.Event()
    calls = 0

    async def review(token: str, path: str) -> tuple[Access, str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            await release.wait()
        return Access.ALLOWED, "someone"

    auth = MetricsAuth(review, asyncio.get_running_loop(), timeout=0.2)
    assert await _check(auth, "t") == "503"
    release.set()
    assert await _check(auth, "t") == "ok" and calls == 2


@pytest.mark.parametrize("error", [ReviewUnavailable("the API server answered 500"), KeyError("expirationTimestamp")])
async def test_a_review_that_fails_is_503(error: Exception) -> None:
    async def review(token: str, path: str) -> tuple[Access, str]:
        raise error

    auth = MetricsAuth(review, asyncio.get_running_loop())
    assert await _check(auth, "t") == "503"
