"""The keep-alive GET client against raw servers that answer exactly what each test says: the
callback connection the scrape loops drive (:class:`GetConnection`), request after request."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from epp.datalayer.httpget import GetConnection, HttpGetError, connect, request_bytes

Answer = Callable[[int], list[bytes]]  # request number -> the byte pieces to send back
Serve = Callable[[Answer], Awaitable["RawServer"]]  # starts a RawServer (the serve fixture)


class RawServer:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"GET /metrics HTTP/1.1\r\n")
                number = self.requests
                self.requests += 1
                pieces = self.answer(number)
                for piece in pieces:
                    if piece == b"<close>":
                        writer.close()
                        return
                    if piece == b"<pause>":
                        await asyncio.sleep(0.05)
                        continue
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.001)  # arrive in separate reads
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    servers: list[RawServer] = []

    async def start(answer: Answer) -> RawServer:
        server = RawServer(answer)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


BODY = b"vllm:num_requests_waiting 3\n" * 2000


def sized(body: bytes, status: bytes = b"200 OK", pieces: int = 1) -> list[bytes]:
    head = b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
    step = max(1, len(body) // pieces)
    return [head] + [body[i : i + step] for i in range(0, len(body), step)]


def chunked(body: bytes) -> list[bytes]:
    parts = [body[i : i + 7000] for i in range(0, len(body), 7000)]
    encoded = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [head, encoded[:5], encoded[5:], b"0\r\nX-Trailer: t\r\n\r\n"]


class Events:
    """What a GetConnection reported, in order."""

    def __init__(self) -> None:
        self.seen: list[object] = []
        self.closed_when_answered: list[bool] = []
        self.connection: GetConnection | None = None

    def response(self, status: int, body: bytes) -> None:
        self.seen.append((status, body))
        assert self.connection is not None
        self.closed_when_answered.append(self.connection.closed)

    def error(self, exc: HttpGetError) -> None:
        self.seen.append(exc)

    async def connect(self, port: int) -> GetConnection:
        self.connection = await connect("127.0.0.1", port, self.response, self.error)
        return self.connection

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()


async def _until(predicate: Callable[[], bool]) -> None:
    for _ in range(300):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


REQUEST = request_bytes("127.0.0.1", 1, "/metrics")


async def _get(events: Events, port: int) -> object:
    """One GET as the scraper makes it: on the open connection, or on a new one if the last was closed;
    returns what was reported for it, ``(status, body)`` or the :class:`HttpGetError`."""
    connection = events.connection
    if connection is None or connection.closed:
        connection = await events.connect(port)
    before = len(events.seen)
    connection.send(REQUEST)
    await _until(lambda: len(events.seen) > before)
    return events.seen[-1]


# --- request after request, on one connection or a new one, as the scrape loops make them ---------


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda n: sized(BODY), id="content-length"),
        pytest.param(lambda n: sized(BODY, pieces=9), id="content-length-in-pieces"),
        pytest.param(lambda n: chunked(BODY), id="chunked-split-everywhere"),
    ],
)
async def test_reads_bodies_on_one_reused_connection(serve: Serve, answer: Answer) -> None:
    server = await serve(answer)
    events = Events()
    try:
        for _ in range(5):
            assert await _get(events, server.port) == (200, BODY)
    finally:
        events.close()
    assert server.connections == 1


async def test_status_is_reported_and_connection_close_is_honoured(serve: Serve) -> None:
    head = sized(b"nope", b"503 Service Unavailable")[0][:-2] + b"Connection: close\r\n\r\n"
    server = await serve(lambda n: [head, b"nope"])
    events = Events()
    try:
        assert await _get(events, server.port) == (503, b"nope")
        assert await _get(events, server.port) == (503, b"nope")  # reconnected after the server's close
    finally:
        events.close()
    assert server.connections == 2


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        pytest.param(lambda n: [b"SSH-2.0-OpenSSH\r\n\r\n"], "not an HTTP/1.1 response", id="not-http"),
        pytest.param(lambda n: [b"HTTP/1.1 200 OK\r\n\r\n"], "neither Content-Length nor chunked", id="no-framing"),
        pytest.param(
            lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"], "bad Content-Length", id="bad-length"
        ),
        pytest.param(
            lambda n: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "bad chunk size", id="bad-chunk"
        ),
        pytest.param(lambda n: [*sized(BODY)[:1], BODY[:100], b"<close>"], "connection closed", id="closed-mid-body"),
    ],
)
async def test_broken_answers_are_errors_and_the_next_request_starts_clean(
    serve: Serve, answer: Answer, message: str
) -> None:
    good = sized(BODY)
    server = await serve(lambda n: answer(n) if n == 0 else good)
    events = Events()
    try:
        failure = await _get(events, server.port)
        assert isinstance(failure, HttpGetError) and re.search(message, str(failure))
        assert events.connection is not None and events.connection.closed  # nothing half-read survives
        assert await _get(events, server.port) == (200, BODY)
    finally:
        events.close()


async def test_a_timeout_abandons_the_connection(serve: Serve) -> None:
    server = await serve(lambda n: [] if n == 0 else sized(BODY))
    events = Events()
    connection = await events.connect(server.port)
    try:
        connection.send(REQUEST)
        await asyncio.sleep(0.2)  # the owner's timeout: no answer came
        connection.close()
        assert await _get(events, server.port) == (200, BODY)  # a new connection: no stale bytes from the first
        assert events.seen == [(200, BODY)]  # the abandoned request was never reported
    finally:
        events.close()
    assert server.connections == 2


# --- the callback connection ------------------------------------------------------------------


async def test_each_response_and_each_failure_is_one_callback(serve: Serve) -> None:
    server = await serve(lambda n: sized(BODY, pieces=3) if n < 2 else [*sized(BODY)[:1], BODY[:10], b"<close>"])
    events = Events()
    connection = await events.connect(server.port)
    def seen(count: int) -> Callable[[], bool]:
        return lambda: len(events.seen) == count

    for expected in (1, 2):
        connection.send(REQUEST)
        assert connection.busy
        await _until(seen(expected))
        assert events.seen[-1] == (200, BODY) and not connection.busy
    connection.send(REQUEST)
    await _until(lambda: len(events.seen) == 3)
    assert isinstance(events.seen[2], HttpGetError) and "connection closed" in str(events.seen[2])
    assert connection.closed and server.connections == 1
    with pytest.raises(HttpGetError, match="connection closed"):
        connection.send(REQUEST)


@pytest.mark.parametrize(
    ("answer", "retryable"),
    [
        # the keep-alive race: the server closes the idle connection as the request arrives
        pytest.param(lambda n: sized(BODY) if n == 0 else [b"<close>"], True, id="reused-closed-unanswered"),
        pytest.param(lambda n: [b"<close>"], False, id="fresh-closed-unanswered"),
        pytest.param(
            lambda n: sized(BODY) if n == 0 else [*sized(BODY)[:1], b"<close>"], False, id="reused-closed-mid-answer"
        ),
    ],
)
async def test_only_a_reused_connection_closed_without_a_byte_of_answer_may_be_retried(
    serve: Serve, answer: Answer, retryable: bool
) -> None:
    server = await serve(answer)
    events = Events()
    try:
        failure = await _get(events, server.port)
        if not isinstance(failure, HttpGetError):  # the first answer of a reused connection
            assert failure == (200, BODY)
            failure = await _get(events, server.port)
        assert isinstance(failure, HttpGetError) and "connection closed" in str(failure)
        assert failure.retryable is retryable
        assert server.connections == 1
    finally:
        events.close()


async def test_one_request_at_a_time(serve: Serve) -> None:
    server = await serve(lambda n: [])  # never answers
    events = Events()
    connection = await events.connect(server.port)
    try:
        connection.send(REQUEST)
        with pytest.raises(HttpGetError, match="already in flight"):
            connection.send(REQUEST)
    finally:
        connection.close()


async def test_an_abandoned_request_is_never_reported(serve: Serve) -> None:
    server = await serve(lambda n: [b"<pause>", *sized(BODY)])  # answers, but late
    events = Events()
    connection = await events.connect(server.port)
    connection.send(REQUEST)
    connection.close()  # the owner gives up (its timeout)
    assert connection.closed and not connection.busy
    await asyncio.sleep(0.15)
    assert events.seen == []


async def test_bytes_nobody_asked_for_close_the_connection_silently(serve: Serve) -> None:
    server = await serve(lambda n: [*sized(BODY), b"<pause>", *sized(b"extra")])
    events = Events()
    connection = await events.connect(server.port)
    connection.send(REQUEST)
    await _until(lambda: connection.closed)
    assert events.seen == [(200, BODY)]  # the unasked-for answer is not reported


async def test_connection_close_is_visible_when_the_response_is_reported(serve: Serve) -> None:
    head = sized(b"ok")[0][:-2] + b"Connection: close\r\n\r\n"
    server = await serve(lambda n: [head, b"ok"])
    events = Events()
    connection = await events.connect(server.port)
    connection.send(REQUEST)
    await _until(lambda: len(events.seen) == 1)
    assert events.seen == [(200, b"ok")] and events.closed_when_answered == [True]  # the next send needs a new one


def test_public_api_is_locked() -> None:
    import epp.datalayer.httpget

    assert epp.datalayer.httpget.__all__ == ["GetConnection", "HttpGetError", "connect", "request_bytes"]


@pytest.mark.parametrize(
    ("host", "authority"),
    [("10.0.0.7", b"10.0.0.7:8000"), ("fd00::7", b"[fd00::7]:8000"), ("pod.local", b"pod.local:8000")],
)
def test_the_request_names_its_host_with_ipv6_bracketed(host: str, authority: bytes) -> None:
    request = request_bytes(host, 8000, "/metrics?name[]=a")
    assert request.startswith(b"GET /metrics?name[]=a HTTP/1.1\r\nHost: " + authority + b"\r\n")
    assert request.endswith(b"\r\n\r\n") and request.count(b"\r\n\r\n") == 1
