"""End to end through a real Envoy: client -> Envoy -> ext_proc picker -> echo backend."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

from epp.testing.envoy import free_port
from tests.e2e.conftest import Stack, StackFactory


def _completion(prompt: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "prompt": prompt, **extra}).encode()


async def _post(stack: Stack, body: bytes, path: str = "/v1/completions", headers: dict[str, str] | None = None) -> tuple[int, dict]:
    async with stack.session.post(stack.url + path, data=body, headers=headers or {}) as response:
        text = await response.text()
        return response.status, json.loads(text) if text.startswith("{") else {"text": text}


async def test_requests_land_on_the_endpoint_the_picker_chose(make_stack: StackFactory) -> None:
    stack = await make_stack()
    # Envoy's health check passes once one pod has answered a scrape; until the other has, it counts as
    # fully loaded and every pick goes to the first (CI once saw 12 of 12 requests go to one pod).
    assert stack.picker is not None
    async with asyncio.timeout(10):
        while any(e.metrics.stale for e in stack.picker.datastore.endpoints()):
            await asyncio.sleep(0.02)
    hit_ports = set()
    for i in range(24):
        status, answer = await _post(stack, _completion(f"hello {i}"))
        assert status == 200, answer
        request_id = answer["headers"]["x-request-id"]
        picked = stack.recorder.picks[request_id]
        assert [e.port for e in picked] == [answer["port"]]
        assert answer["headers"]["x-gateway-destination-endpoint"] == picked[0].hostport
        hit_ports.add(answer["port"])
    # Idle pods tie and ties are broken at random: all 24 on one pod is a chance of 2**-23.
    assert hit_ports == {b.port for b in stack.backends[:2]}
    assert not stack.backends[2].received  # not a pool member


@pytest.mark.parametrize("size", [100_000, 5_000_000])
async def test_large_bodies_arrive_byte_identical(make_stack: StackFactory, size: int) -> None:
    stack = await make_stack()
    body = _completion("z" * size)
    status, answer = await _post(stack, body)
    assert status == 200, answer
    assert answer["body_len"] == len(body)
    assert answer["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_empty_body_is_routed_and_arrives_empty(make_stack: StackFactory) -> None:
    stack = await make_stack()
    status, answer = await _post(stack, b"", path="/v1/echo")
    assert status == 200, answer
    assert answer["body_len"] == 0
    assert answer["body_sha256"] == hashlib.sha256(b"").hexdigest()


async def test_get_is_routed(make_stack: StackFactory) -> None:
    stack = await make_stack()
    async with stack.session.get(stack.url + "/v1/models") as response:
        answer = await response.json()
    assert response.status == 200
    assert answer["method"] == "GET"
    assert stack.recorder.picks[answer["headers"]["x-request-id"]][0].port == answer["port"]


async def test_sse_streams_through_chunk_by_chunk(make_stack: StackFactory) -> None:
    stack = await make_stack()
    tokens = 8
    arrivals: list[float] = []
    async with stack.session.post(stack.url + "/v1/completions", data=_completion("s", stream=True, max_tokens=tokens)) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                arrivals.append(time.monotonic())
                last = event
    assert len(arrivals) == tokens + 1  # tokens, then [DONE]
    assert last == b"data: [DONE]"
    # The backend spaces events 50 ms apart: a proxy that buffered the response would deliver them
    # all at once at the end.
    assert arrivals[-1] - arrivals[0] > 0.5 * 0.05 * tokens


async def test_a_streamed_request_stops_counting_as_unanswered_at_its_first_chunk(make_stack: StackFactory) -> None:
    stack = await make_stack()
    assert stack.picker is not None
    inflight = lambda: [(e.inflight.requests, e.inflight.unanswered) for e in stack.picker.datastore.endpoints()]  # noqa: E731
    async with stack.session.post(stack.url + "/v1/completions", data=_completion("s", stream=True, max_tokens=8)) as response:
        assert response.status == 200
        await response.content.readuntil(b"\n\n")  # the first event: the pod is past its prefill
        deadline = time.monotonic() + 2
        while sorted(inflight()) != [(0, 0), (1, 0)] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert sorted(inflight()) == [(0, 0), (1, 0)]  # still in flight, no longer unanswered
        await response.read()
    deadline = time.monotonic() + 2
    while inflight() != [(0, 0), (0, 0)] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert inflight() == [(0, 0), (0, 0)]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "m", "prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        (b'{"model": "m", "prompt": 5}', 400, "$.prompt"),
        (b'{"model": 7, "prompt": "x"}', 400, "$.model"),
    ],
)
async def test_bad_requests_get_a_clear_error_and_the_next_request_works(
    make_stack: StackFactory, body: bytes, status: int, message: str
) -> None:
    stack = await make_stack()
    got, answer = await _post(stack, body)
    assert got == status
    assert message in answer["error"]["message"]
    assert answer["error"]["code"] == status
    assert not any(b.received for b in stack.backends)  # no backend saw it
    got, answer = await _post(stack, _completion("fine"))
    assert got == 200


@pytest.mark.parametrize(
    "body",
    [
        # issue 13: vLLM 0.32 serves each of these (pydantic's lax mode; no model is its default model)
        b'{"model": "m", "prompt": "x", "max_tokens": "3"}',
        b'{"model": "m", "prompt": "x", "max_tokens": 3.0}',
        b'{"model": "m", "prompt": "x", "stream": "false"}',
        b'{"prompt": "x"}',
    ],
)
async def test_bodies_vllm_serves_are_routed(make_stack: StackFactory, body: bytes) -> None:
    stack = await make_stack()
    got, answer = await _post(stack, body)
    assert got == 200, answer
    assert sum(len(b.received) for b in stack.backends[:2]) == 1


async def test_oversize_body_gets_413_naming_the_limit(make_stack: StackFactory) -> None:
    stack = await make_stack(max_request_body_bytes=1_000_000)
    got, answer = await _post(stack, _completion("x" * 2_000_000))
    assert got == 413
    assert "1000000 bytes" in answer["error"]["message"]
    assert not any(b.received for b in stack.backends)
    got, _ = await _post(stack, _completion("fine"))
    assert got == 200


async def test_forged_destination_headers_are_ignored(make_stack: StackFactory) -> None:
    stack = await make_stack()
    outsider = stack.backends[2]  # running, but not in the pool
    forged = {
        "x-gateway-destination-endpoint": outsider.hostport,
        "x-gateway-destination-endpoint-subset": outsider.hostport,
        "x-gateway-destination-endpoint-fallback": outsider.hostport,
    }
    for i in range(6):
        status, answer = await _post(stack, _completion(f"forged {i}"), headers=forged)
        assert status == 200
        assert answer["port"] != outsider.port
        seen = answer["headers"]
        assert seen["x-gateway-destination-endpoint"] == f"127.0.0.1:{answer['port']}"
        assert "x-gateway-destination-endpoint-subset" not in seen
        assert "x-gateway-destination-endpoint-fallback" not in seen
    assert not outsider.received


async def test_200_concurrent_requests_all_succeed(make_stack: StackFactory) -> None:
    stack = await make_stack()
    bodies = [_completion(f"concurrent {i} " + "p" * (i * 37 % 3000)) for i in range(200)]
    results = await asyncio.gather(*(_post(stack, body) for body in bodies))
    assert [status for status, _ in results] == [200] * 200
    for body, (_, answer) in zip(bodies, results, strict=True):
        assert answer["body_sha256"] == hashlib.sha256(body).hexdigest()


async def test_buffered_request_bodies_work(make_stack: StackFactory) -> None:
    stack = await make_stack(request_body_mode="BUFFERED")
    body = _completion("b" * 300_000)
    status, answer = await _post(stack, body)
    assert status == 200, answer
    assert answer["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert stack.recorder.picks[answer["headers"]["x-request-id"]][0].port == answer["port"]
    got, answer = await _post(stack, b"{oops")
    assert got == 400


async def test_tls_to_the_picker(make_stack: StackFactory) -> None:
    stack = await make_stack(tls=True)
    status, answer = await _post(stack, _completion("over tls"))
    assert status == 200, answer
    assert stack.recorder.picks[answer["headers"]["x-request-id"]][0].port == answer["port"]


async def test_fallback_endpoints_are_listed_and_the_primary_is_used(make_stack: StackFactory) -> None:
    config = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
  parameters: {maxNumOfEndpoints: 2}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: random-picker}]
"""
    stack = await make_stack(config_text=config)
    status, answer = await _post(stack, _completion("two"))
    assert status == 200
    picked = stack.recorder.picks[answer["headers"]["x-request-id"]]
    assert len(picked) == 2
    assert answer["port"] == picked[0].port


async def test_picker_down_fail_closed_answers_5xx(make_stack: StackFactory) -> None:
    stack = await make_stack(picker=False, picker_port=free_port())
    status, _ = await _post(stack, _completion("nobody home"))
    assert 500 <= status < 600
    assert not any(b.received for b in stack.backends)


async def test_picker_down_fail_open_reaches_a_pool_member_never_a_forged_one(make_stack: StackFactory) -> None:
    stack = await make_stack(picker=False, picker_port=free_port(), fail_open=True)
    outsider = stack.backends[2]
    pool_ports = {b.port for b in stack.backends[:2]}
    for i in range(6):
        status, answer = await _post(
            stack, _completion(f"open {i}"), headers={"x-gateway-destination-endpoint": outsider.hostport}
        )
        assert status == 200, answer
        assert answer["port"] in pool_ports
    assert not outsider.received


async def _raw_exchange(stack: Stack, request: bytes) -> bytes:
    """Send ``request`` as raw bytes; what Envoy answers before it closes (b"" if nothing)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.envoy.listen_port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), timeout=10)
    except (ConnectionResetError, BrokenPipeError):
        return b""
    finally:
        writer.close()


_LOCAL_REPLIES = [
    pytest.param(b"GET /v1/models HTTP/1.0\r\nHost: x\r\n\r\n", b"426", id="http-1.0"),
    pytest.param(
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(200)) + b"\r\n",
        b"431",
        id="200-headers",
    ),
    pytest.param(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-big: " + b"v" * 61_440 + b"\r\n\r\n", b"431", id="60kb-header"),
]


@pytest.mark.parametrize("fail_open", [False, True])
@pytest.mark.parametrize("picker_up", [True, False])
@pytest.mark.parametrize(("request_bytes", "status"), _LOCAL_REPLIES)
async def test_envoys_own_local_replies_reach_the_client(
    make_stack: StackFactory, request_bytes: bytes, status: bytes, fail_open: bool, picker_up: bool
) -> None:
    # Envoy answers these itself (426 Upgrade Required, 431 Request Header Fields Too Large), as a
    # plain Envoy does: the picker's configs must not swallow them (issue 15, item 2).
    if picker_up:
        stack = await make_stack(fail_open=fail_open)
    else:
        stack = await make_stack(picker=False, picker_port=free_port(), fail_open=fail_open)
    answer = await _raw_exchange(stack, request_bytes)
    assert answer.split(b"\r\n", 1)[0].startswith(b"HTTP/1.1 " + status), answer[:200]
    got, _ = await _post(stack, _completion("fine"))  # and the gateway works as before for the next request
    if picker_up or fail_open:
        assert got == 200
    else:
        assert 500 <= got < 600
