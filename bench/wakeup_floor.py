"""What one wake-up per message costs a server: the floor under the picker's per-chunk CPU at one stream.

A client sends one small message and waits for the answer, ``--gap`` seconds apart (2 ms: a decoding
engine's pace, so that every message wakes the server from idle), ``--messages`` times; the server is
a child process, and its CPU (user + system, from /proc) per message is reported. Servers:

* ``c-epoll``:   a C epoll loop echoing the bytes (compiled here with the C compiler the project's
  own extensions need): the kernel's part, wake-up, read and write;
* ``uvloop``:    the same echo as a Python ``asyncio.Protocol`` on uvloop;
* ``wire``:      the picker's transport without its I/O thread: an :class:`epp.wire.server.GrpcServer`
  serving ext_proc, one stream already routed, each message an Envoy-shaped ``response_body`` chunk
  answered by the C read path (:mod:`epp.wire._fast`);
* ``wire-thread``: the same with the connection lent to the picker's native I/O thread (``--io-thread``,
  on plaintext ports by default): the chunks are answered there, the event loop never woken;
* ``wire-python``: the same with the stream's echo off: every chunk goes through the Python call
  (protobuf decode, the answer built and serialized with upb).

Rounds alternate the servers; medians are printed. ``--gap 0`` measures back-to-back messages instead.

    python bench/wakeup_floor.py [--messages 3000] [--gap 0.002] [--rounds 3]

Talks only to 127.0.0.1; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hpack
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.testing.harness import cpu_seconds

_C_ECHO = r"""
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int listener = atoi(argv[1]), one = 1;
    int c = accept(listener, 0, 0);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = c};
    epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev);
    static char buf[65536];
    for (;;) {
        struct epoll_event out[8];
        int n = epoll_wait(ep, out, 8, -1);
        for (int i = 0; i < n; i++) {
            ssize_t r = read(c, buf, sizeof buf);
            if (r <= 0) return 0;
            if (write(c, buf, r) != r) return 1;
        }
    }
}
"""
_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# An SSE event as a vLLM server writes one, in the message Envoy sends for it (with its empty metadata_context).
_CHUNK = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" token"}]}\n\n'


class _Routed:
    """The routed request a served stream reports to: nothing to do (the transport alone is measured)."""

    def response_body_started(self) -> None: ...
    def response_ended(self, *args: object) -> None: ...
    def response_headers(self, headers: object) -> None: ...
    def finish(self, outcome: str) -> None: ...


def _serve_wire(listener: socket.socket, echo: bool, io_thread: bool = False) -> None:
    import uvloop

    from epp.extproc.processor import ExternalProcessor
    from epp.wire.http2 import Stream
    from epp.wire.server import GrpcServer

    if not echo:  # this child process only: every chunk goes through the Python call
        Stream.echo_response_bodies = lambda self: None  # type: ignore[method-assign]
    processor = ExternalProcessor(None, None, max_request_body_bytes=1 << 20)  # type: ignore[arg-type]

    def open_call(wire):  # type: ignore[no-untyped-def]
        call = processor.open(wire)
        call._stream.routed = _Routed()  # type: ignore[assignment]  # routed already: the response phase
        call._stream.done = True
        return call

    async def main() -> None:
        GrpcServer({_PATH: open_call}, max_message=1 << 20, io_thread=io_thread).serve_socket(listener)
        await asyncio.Event().wait()

    uvloop.run(main())


def _serve_uvloop(listener: socket.socket) -> None:
    import uvloop

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)  # type: ignore[attr-defined]

    async def main() -> None:
        await asyncio.get_running_loop().create_server(Echo, sock=listener)
        await asyncio.Event().wait()

    uvloop.run(main())


def _start(kind: str, work: Path) -> tuple[int, int]:
    """(pid, port) of a server of ``kind``, listening."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    if kind == "c-epoll":
        binary = work / "echo"
        if not binary.exists():
            (work / "echo.c").write_text(_C_ECHO)
            subprocess.run([shutil.which("cc") or "gcc", "-O2", "-o", str(binary), str(work / "echo.c")], check=True)
        process = subprocess.Popen([str(binary), str(listener.fileno())], pass_fds=[listener.fileno()])
        listener.close()
        return process.pid, port
    pid = os.fork()
    if pid == 0:  # the server child: never returns
        try:
            if kind == "uvloop":
                _serve_uvloop(listener)
            else:
                _serve_wire(listener, echo=kind != "wire-python", io_thread=kind == "wire-thread")
        finally:
            os._exit(0)
    listener.close()
    return pid, port


def _client(kind: str, port: int, messages: int, gap: float) -> float:
    """Send ``messages`` one at a time, ``gap`` apart, each answer awaited; the seconds it took."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    message = pb.ProcessingRequest(response_body=pb.HttpBody(body=_CHUNK))
    message.metadata_context.SetInParent()
    data = message.SerializeToString()
    frame = struct.pack(">IBIBI", (len(data) + 5) << 8, 0, 1, 0, len(data)) + data
    if kind.startswith("wire"):
        block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", _PATH), ("content-type", "application/grpc"), ("te", "trailers")])
        settings = struct.pack(">IBI", 6 << 8 | 4, 0, 0) + struct.pack(">HI", 4, 2**31 - 1)
        window = struct.pack(">IBI", 4 << 8 | 8, 0, 0) + struct.pack(">I", 2**31 - 1 - 65_535)
        headers = struct.pack(">IBI", len(block) << 8 | 1, 4, 1) + block
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings + window + headers)
        sock.sendall(frame)  # the first chunk: the response starts (Python), then the echo is on
        time.sleep(0.2)
        sock.recv(1 << 16)
    start = time.monotonic()
    for _ in range(messages):
        sock.sendall(frame)
        sock.recv(1 << 16)
        if gap:
            time.sleep(gap)
    elapsed = time.monotonic() - start
    sock.close()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--gap", type=float, default=0.002, help="seconds between messages (0: back to back)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", default="c-epoll,uvloop,wire,wire-thread,wire-python")
    args = parser.parse_args(argv)
    kinds = args.servers.split(",")
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="epp-wakeup-") as work:
        for _ in range(args.rounds):
            for kind in kinds:
                pid, port = _start(kind, Path(work))
                try:
                    time.sleep(0.5)
                    before = cpu_seconds(pid)
                    _client(kind, port, args.messages, args.gap)
                    results[kind].append((cpu_seconds(pid) - before) / args.messages * 1e6)
                finally:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
    print(f"\nserver CPU per message, {args.messages} messages {args.gap * 1e3:g} ms apart, {args.rounds} rounds, medians\n")
    for kind in kinds:
        rounds = ", ".join(f"{v:.1f}" for v in results[kind])
        print(f"{kind:>12}: {statistics.median(results[kind]):6.1f} µs   (rounds: {rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
