"""A gRPC server on asyncio: listening sockets, TLS, and the connections of :mod:`epp.wire.http2`.

:class:`GrpcServer` serves a table of methods (``"/package.Service/Method"`` -> handler) on one or
more listening sockets, plaintext or TLS. It binds without ``SO_REUSEPORT``, so that a second
process on the same port fails to start instead of silently taking half of the streams; a worker
process serves the connections its parent accepted and handed over (:meth:`GrpcServer.serve_connection`;
``max_concurrent_streams`` announces a per-connection stream limit, so that a client such as Envoy
opens more connections under load, which the parent spreads over its workers).

A client that says nothing is closed after ``first_bytes_timeout`` seconds (30): its first bytes on
a TLS port, the HTTP/2 preface (after the handshake on a TLS port) on either kind. Mismatches are
explained, once a minute at most: each connection's first byte says what the client speaks before
anything is decoded. On a TLS port, a connection whose first bytes are not a TLS handshake (Envoy's
cluster without a ``transport_socket`` sends the plaintext HTTP/2 preface) is logged with what to
change on either side and closed; on a plaintext port, a TLS ClientHello is. TLS itself, with ALPN
``h2``, is :class:`epp.wire._fast.TlsTransport`'s: OpenSSL in C between uvloop's socket transport and
the connection, so that a TLS connection's streamed chunks are answered without Python code too, and
lent to the I/O thread like a plaintext one's (``--io-thread``). Where that module's OpenSSL is not
Python's (``tls_usable``) or ``native_tls`` is off, it is the event loop's
``connect_accepted_socket(ssl=...)``. A handshake not done in 10 seconds is given up.

Stopping (:meth:`GrpcServer.stop`): the listening sockets close, every connection gets a graceful
GOAWAY (:meth:`epp.wire.http2.Connection.goaway`: the peer opens new streams elsewhere, the open ones
go on, and so do those it opened before it read the GOAWAY; later ones are refused with
REFUSED_STREAM), the open streams get ``grace`` seconds to end, then the connections close and the
calls left are cancelled, before ``stop`` returns (not when a TLS peer answers the close).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Mapping
from typing import cast

from epp.framework.helpers import LogLimiter
from epp.wire._fast import TlsTransport, set_lend_after, tls_usable
from epp.wire.http2 import PREFACE, Connection, Handler

__all__ = ["GrpcServer", "bind_socket"]

log = logging.getLogger(__name__)

_TLS_RECORD = 0x16  # the first byte of a TLS handshake record (a ClientHello)
_FIRST_BYTES_TIMEOUT = 30.0  # a connection that says nothing for this long is closed
_PEEK_AGAIN = 0.01  # seconds between looks at a connection's first bytes while they are a partial preface
_HANDSHAKE_TIMEOUT = 10.0


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port), without SO_REUSEPORT; OSError if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; not REUSEPORT
        sock.bind((host.strip("[]"), port))
        sock.listen(1024)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class GrpcServer:
    """Serves ``methods`` on the sockets given to :meth:`serve_socket`; ``ssl_context`` for TLS."""

    def __init__(
        self,
        methods: Mapping[str, Handler],
        *,
        ssl_context: ssl.SSLContext | None = None,
        max_message: int = 4 * 1024 * 1024,
        flag: str = "the port",
        max_concurrent_streams: int = 0,
        first_bytes_timeout: float = _FIRST_BYTES_TIMEOUT,
        io_thread: bool = True,
        io_thread_after_chunks: int | None = None,
        native_tls: bool = True,
    ) -> None:
        self._methods = methods
        self._max_streams = max_concurrent_streams  # announced per connection when given (see Connection)
        self._ssl = ssl_context
        if ssl_context is not None:
            ssl_context.set_alpn_protocols(["h2"])
        self.native_tls = ssl_context is not None and native_tls and tls_usable(ssl_context)
        self._io_thread = io_thread and (ssl_context is None or self.native_tls)
        if self._io_thread and io_thread_after_chunks is not None:
            set_lend_after(io_thread_after_chunks)  # (process-wide: one ext_proc server per process)
        self._max_message = max_message
        self._flag = flag  # how the operator names this port, for log lines ("--grpc-port 9002")
        self._first_bytes_timeout = first_bytes_timeout
        self._sockets: list[socket.socket] = []
        self._connections: set[Connection] = set()
        self._sniffing: set[socket.socket] = set()
        self._handshakes: set[asyncio.Task[None]] = set()
        self._mismatches = LogLimiter(60.0)  # one log line per kind per minute at most
        self._stopping = False

    @property
    def connections(self) -> int:
        return len(self._connections)

    def serve_socket(self, sock: socket.socket) -> int:
        """Accept connections on the listening ``sock`` (non-blocking) from now on; its port."""
        sock.setblocking(False)
        self._sockets.append(sock)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept, sock)
        return int(sock.getsockname()[1])

    # -- accepting --------------------------------------------------------------------------------

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):  # a burst of new connections, bounded per wake-up
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: keep serving what is open
                log.warning("%s: cannot accept a connection: %s", self._flag, exc)
                return
            self.serve_connection(sock)

    def serve_connection(self, sock: socket.socket) -> None:
        """Serve a connection accepted here or handed over by another process (epp.server.workers)."""
        if self._stopping:
            sock.close()
            return
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._ssl is None:
            self._start(sock, None)
        else:  # the first byte says whether the client speaks TLS
            self._sniffing.add(sock)
            deadline = loop.call_later(self._first_bytes_timeout, self._give_up, sock)
            loop.add_reader(sock.fileno(), self._first_bytes, sock, deadline)

    def _give_up(self, sock: socket.socket) -> None:
        if sock in self._sniffing:
            self._sniffing.discard(sock)
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()

    def _first_bytes(self, sock: socket.socket, deadline: asyncio.TimerHandle) -> None:
        loop = asyncio.get_running_loop()
        try:
            head = sock.recv(len(PREFACE), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            head = b""
        if head and head[0] != _TLS_RECORD and len(head) < len(PREFACE) and PREFACE.startswith(head):
            # Part of a plaintext preface: look again shortly, to say exactly what it is. (Not on the
            # reader: a socket we only peek at stays readable, and the reader would spin.)
            loop.remove_reader(sock.fileno())
            loop.call_later(_PEEK_AGAIN, self._watch, sock, deadline)
            return
        loop.remove_reader(sock.fileno())
        deadline.cancel()
        self._sniffing.discard(sock)
        if not head:  # closed before saying anything
            sock.close()
            return
        if head[0] == _TLS_RECORD:
            self._start(sock, self._ssl)
            return
        peer = _peer(sock)
        what = "plaintext HTTP/2 (gRPC without TLS)" if head.startswith(PREFACE[:14]) else f"{head[:24]!r}, not TLS"
        self._mismatch(
            "plaintext-on-tls",
            f"{self._flag} serves TLS (--secure-serving=true, the default), and {peer} sent {what}: give the "
            "gateway's cluster for the picker a TLS transport_socket (deploy/envoy/envoy-tls.yaml pairs with "
            "this), or start the picker with --secure-serving=false to serve plaintext",
        )
        _close(sock)

    def _watch(self, sock: socket.socket, deadline: asyncio.TimerHandle) -> None:
        if sock in self._sniffing:  # not given up meanwhile
            asyncio.get_running_loop().add_reader(sock.fileno(), self._first_bytes, sock, deadline)

    def _start(self, sock: socket.socket, context: ssl.SSLContext | None) -> None:
        task = asyncio.get_running_loop().create_task(self._connect(sock, context))
        self._handshakes.add(task)
        task.add_done_callback(self._handshakes.discard)

    async def _connect(self, sock: socket.socket, context: ssl.SSLContext | None) -> None:
        loop = asyncio.get_running_loop()
        if context is not None and self.native_tls:
            await self._connect_tls(sock, context)
            return
        try:
            timeout = _HANDSHAKE_TIMEOUT if context else None
            await loop.connect_accepted_socket(self._connection, sock, ssl=context, ssl_handshake_timeout=timeout)
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            self._mismatch("handshake", f"{self._flag}: the TLS handshake with {_peer(sock)} failed: {exc}")
            sock.close()

    async def _connect_tls(self, sock: socket.socket, context: ssl.SSLContext) -> None:
        """TLS in C (:class:`TlsTransport`): the connection is made once the handshake is done."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str | None] = loop.create_future()

        def ready(_transport: TlsTransport, error: str | None) -> None:
            if not ended.done():
                ended.set_result(error)

        tls = TlsTransport(context, self._connection, ready)
        peer = _peer(sock)
        try:
            # (a protocol by its methods: a C type, not a subclass of asyncio.Protocol)
            await loop.connect_accepted_socket(lambda: cast(asyncio.Protocol, tls), sock)
        except OSError as exc:
            sock.close()
            self._mismatch("handshake", f"{self._flag}: the TLS handshake with {peer} failed: {exc}")
            return
        try:
            error = await asyncio.wait_for(asyncio.shield(ended), _HANDSHAKE_TIMEOUT)
        except TimeoutError:
            error = f"no handshake in {_HANDSHAKE_TIMEOUT:g} s"
        finally:
            if not ended.done():  # timed out, or the server stops meanwhile: the transport closes the socket
                tls.abort()
        if error is not None:
            self._mismatch("handshake", f"{self._flag}: the TLS handshake with {peer} failed: {error}")

    def _connection(self) -> Connection:
        connection = Connection(
            self._methods,
            max_message=self._max_message,
            on_close=self._connections.discard,
            on_bad_preface=self._bad_preface,
            max_concurrent_streams=self._max_streams,
            io_thread=self._io_thread,
        )
        self._connections.add(connection)
        if self._stopping:
            connection.goaway()
        asyncio.get_running_loop().call_later(self._first_bytes_timeout, self._silent, connection)
        return connection

    def _silent(self, connection: Connection) -> None:
        """A connection that has not sent the HTTP/2 preface by now will not: it is closed."""
        if not connection.started:
            connection.close()

    def _bad_preface(self, connection: Connection, head: bytes) -> None:
        if head[:1] == bytes((_TLS_RECORD,)):
            self._mismatch(
                "tls-on-plaintext",
                f"{self._flag} serves plaintext (--secure-serving=false), and {connection.peer} started a TLS "
                "handshake: remove the TLS transport_socket from the gateway's cluster for the picker "
                "(deploy/envoy/envoy.yaml pairs with this), or start the picker with --secure-serving=true",
            )
        else:
            self._mismatch(
                "not-http2",
                f"{self._flag} speaks gRPC (HTTP/2), and {connection.peer} sent {head[:24]!r}: point HTTP/1 "
                "clients at the gateway, not at the picker",
            )

    def _mismatch(self, kind: str, message: str) -> None:
        """Log ``message`` at most once a minute per kind, saying how many were left unsaid."""
        more = self._mismatches.allow(kind)
        if more is None:
            return
        log.warning("%s%s", message, f" ({more} more such connections in the last minute)" if more else "")

    def goaway_busiest(self) -> int:
        """GOAWAY the connection that carried the most streams since the previous call (its peer takes new
        streams elsewhere, the open ones finish); how many it carried (0: none carried any, nothing sent).

        Carried, not open: a connection with sequential requests has no stream open most of the time,
        and the one with the most open at an instant may be a quiet one holding a long stream (measured:
        choosing by open streams, the rebalancing test's busy connection was missed, 21,911 requests
        to 0)."""
        carried: dict[Connection, int] = {}
        for c in self._connections:
            opened = c.streams_opened
            if not c.going_away:
                carried[c] = opened - c.opened_mark
            c.opened_mark = opened
        busiest = max(carried, key=lambda c: (carried[c], len(c.streams)), default=None)
        if busiest is None or not carried[busiest]:  # an open stream stays where it is: no load to move
            return 0
        busiest.goaway()
        return carried[busiest]

    # -- stopping ---------------------------------------------------------------------------------

    async def stop(self, grace: float) -> None:
        """Stop accepting, GOAWAY every connection, give open streams ``grace`` seconds, then close all."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        for sock in self._sockets:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._sockets.clear()
        for sock in list(self._sniffing):
            self._give_up(sock)
        for task in list(self._handshakes):
            task.cancel()
        connections = list(self._connections)
        idle = []
        for connection in connections:
            connection.idle = asyncio.Event()
            connection.goaway()
            connection.close_if_idle()
            idle.append(connection.idle)
        if idle and grace > 0:
            try:
                async with asyncio.timeout(grace):
                    await asyncio.gather(*(event.wait() for event in idle))
            except TimeoutError:
                pass
        for connection in connections:
            connection.close()
        await asyncio.sleep(0)  # let the transports deliver connection_lost (the calls' cancel)


def _close(sock: socket.socket) -> None:
    """Close a connection we have only peeked at: what it sent is read first, so that the client sees
    the end of the stream (FIN) rather than a reset (what closing with unread data does)."""
    with contextlib.suppress(OSError):
        sock.recv(1 << 16)
    sock.close()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "a client"
    return f"{host}:{port}"
