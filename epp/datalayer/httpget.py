"""A keep-alive HTTP/1.1 GET client for one URL, built for scraping /metrics 20 times a second.

Why not aiohttp's client: at the upstream cadence (every 50 ms) a pool of 100 pods means 2,000
requests a second, and a general client's per-request bookkeeping (cookie jar, redirects, headers
multidict, trace hooks, connection-pool lookups) cost more CPU than parsing the page did (measured
in bench/scrape_cost.py). Scraping needs one thing: the same GET on one persistent connection, the
body as bytes.

:class:`GetConnection` does exactly that, as an ``asyncio.Protocol`` driven by callbacks: ``send()``
writes the request bytes built once (:func:`request_bytes`); the response is framed with
Content-Length or chunked encoding as it arrives, and its end calls ``on_response(status, body)``,
or a failure (connection closed, not HTTP/1.1, bad framing) calls ``on_error(exc)`` and closes the
connection so that nothing half-read survives. No future, task or timer is made per request: the
scraper pays only for the socket calls and the framing. Timeouts are the caller's: it abandons a
request with :meth:`GetConnection.close`, after which the connection never calls back; a new
request after a failure or a ``Connection: close`` needs a new connection (:func:`connect`). TLS
(``https``) is the transport's business.

The keep-alive race. A server closes a connection that was idle for its keep-alive timeout (uvicorn's
5 s in vLLM and SGLang) without a word; a request written while that close is on its way gets the
connection closed (or reset) with no byte of an answer, though the server never saw the request. The
scrape loops keep their connections far busier than that, but a process that stalls (a starved machine,
a paused container) finds all of them closed at once. As HTTP allows for an idempotent request (RFC 9110
9.2.2) and mature clients do (Go's ``net/http`` transport, urllib3), such a failure is reported with
:attr:`HttpGetError.retryable` set - the connection had answered before and closed without a byte of
this answer - and the owner sends the GET once more on a new connection. A fresh connection closed
unanswered is not retryable: the server refused the request itself.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import cast

__all__ = ["GetConnection", "HttpGetError", "connect", "request_bytes"]

_MAX_HEADER_BYTES = 64 * 1024
_MAX_BODY_BYTES = 64 * 1024 * 1024


class HttpGetError(Exception):
    """The server closed the connection or answered something that is not HTTP/1.1."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        """The request may be sent again on a new connection: a reused connection closed without a
        byte of its answer (the keep-alive race; see the module docstring)."""


def request_bytes(host: str, port: int, path: str) -> bytes:
    """The bytes of ``GET path`` to ``host:port`` (an IPv6 address is bracketed in the Host header)."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: epp\r\nAccept: text/plain\r\n\r\n".encode()


class GetConnection(asyncio.Protocol):
    """One persistent connection: one request at a time, each answer reported through a callback.

    ``on_response(status, body)`` is called once per complete response, ``on_error(exc)`` (an
    :class:`HttpGetError`) once per request that failed; neither is called for a request the owner
    abandoned with :meth:`close`. After a response with ``Connection: close``, or any failure,
    :attr:`closed` is already true when the callback runs: the next request needs a new connection.
    """

    __slots__ = (
        "_answered", "_body", "_chunked", "_close_after", "_head", "_heard", "_length", "_on_error", "_on_response",
        "_raw", "_status", "busy", "closed", "transport",
    )  # fmt: skip

    def __init__(self, on_response: Callable[[int, bytes], None], on_error: Callable[[HttpGetError], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.busy = False
        """A request was sent and its response has not been reported yet."""
        self._on_response = on_response
        self._on_error = on_error
        self._head = b""  # the start of a response head that arrived in pieces
        self._status = 0
        self._length = -1  # body bytes expected; -1: head not read yet (or chunked)
        self._chunked = False
        self._close_after = False
        self._body = bytearray()  # the body so far, when it comes in pieces
        self._raw = bytearray()  # chunked: what arrived and is not decoded into _body yet
        self._answered = False  # a response was read on this connection: it is a reused one
        self._heard = False  # a byte of the answer to the request in flight arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection's: a read-write Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy:
            self.busy = False
            message = f"connection closed: {exc}" if exc else "connection closed by the server"
            self._on_error(HttpGetError(message, retryable=self._answered and not self._heard))

    def send(self, request: bytes) -> None:
        """Write ``request``; its response will be reported. One request at a time."""
        if self.closed or self.transport is None:
            raise HttpGetError("connection closed")
        if self.busy:
            raise HttpGetError("a request is already in flight")
        self.busy = True
        self._heard = False
        self._head = b""
        self._length = -1
        self._chunked = False
        self._close_after = False
        if self._body or self._raw:
            self._body = bytearray()
            self._raw = bytearray()
        self.transport.write(request)

    def close(self) -> None:
        """Close the connection; a request in flight is abandoned and will not be reported."""
        self.busy = False
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            self.close()  # bytes nobody asked for: this connection can no longer be trusted
            return
        self._heard = True
        try:
            if self._length < 0 and not self._chunked:
                if self._head:
                    data = self._head + data
                    self._head = b""
                end = data.find(b"\r\n\r\n")
                if end < 0:
                    if len(data) > _MAX_HEADER_BYTES:
                        raise HttpGetError("response headers too large")
                    self._head = data
                    return
                self._read_head(data[:end])
                data = data[end + 4 :]
            if self._chunked:
                self._raw += data
                if not self._read_chunks():
                    return
                body = bytes(self._body)
            else:
                length = self._length
                if self._body:
                    self._body += data
                    if len(self._body) < length:
                        return
                    body = bytes(self._body[:length])
                elif len(data) >= length:  # the usual case: the whole body in one read, no extra copy
                    body = data if len(data) == length else data[:length]
                else:
                    self._body += data
                    return
        except HttpGetError as exc:
            self.close()
            self._on_error(exc)
            return
        # Bytes past the end of the response (none in practice: one request at a time) are dropped.
        self.busy = False
        self._answered = True
        if self._close_after:
            self.close()
        self._on_response(self._status, body)

    def _read_head(self, head: bytes) -> None:
        status_line, _, fields = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise HttpGetError(f"not an HTTP/1.1 response: {status_line[:80]!r}")
        self._status = int(parts[1])
        length = None
        for line in fields.lower().split(b"\r\n"):
            name, _, value = line.partition(b":")
            name = name.strip()
            if name == b"content-length":
                value = value.strip()
                if not value.isdigit():
                    raise HttpGetError("bad Content-Length")
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value:
                self._chunked = True
            elif name == b"connection" and value.strip() == b"close":
                self._close_after = True
        if not self._chunked:
            if length is None:
                raise HttpGetError("response has neither Content-Length nor chunked encoding")
            if length > _MAX_BODY_BYTES:
                raise HttpGetError(f"response body of {length} bytes is too large")
            self._length = length

    def _read_chunks(self) -> bool:
        """Decode the complete chunks in ``_raw`` into ``_body``; True once the last one and the trailers are in."""
        raw = self._raw
        while True:
            line_end = raw.find(b"\r\n")
            if line_end < 0:
                return False
            size_text = bytes(raw[:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise HttpGetError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                trailer_end = raw.find(b"\r\n\r\n", line_end)
                if trailer_end < 0:
                    return False
                del raw[: trailer_end + 4]
                return True
            if len(raw) < line_end + 2 + size + 2:
                return False
            self._body += raw[line_end + 2 : line_end + 2 + size]
            if len(self._body) > _MAX_BODY_BYTES:
                raise HttpGetError("response body too large")
            del raw[: line_end + 2 + size + 2]


async def connect(
    host: str,
    port: int,
    on_response: Callable[[int, bytes], None],
    on_error: Callable[[HttpGetError], None],
    *,
    tls: ssl.SSLContext | None = None,
) -> GetConnection:
    """Open a :class:`GetConnection` to ``host:port`` (raises ``OSError`` if it cannot)."""
    loop = asyncio.get_running_loop()
    _, connection = await loop.create_connection(lambda: GetConnection(on_response, on_error), host, port, ssl=tls)
    return connection

