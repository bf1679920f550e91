"""Does a bare grpc.aio bidi-stream server grow per stream? A reproduction with no epp code in it.

The picker's RSS grew ~95 bytes per routed request (issue 14) while tracemalloc saw no Python
objects grow, and driving the servicer in-process without gRPC showed no growth. This script takes
epp out: a child process serves one generic bidi-streaming method (raw bytes, no protobuf) with
``grpc.aio``, the way the picker serves ext_proc, and this process drives it the way Envoy does:
many short streams on one HTTP/2 connection, each a few messages each way, then one of

* ``halfclose``: the client half-closes after its last message, the server's handler returns;
* ``server-first``: the server's handler returns after its last answer, the client half-closes later;
* ``cancel``: the client cancels the stream after its last answer, without a half-close;
* ``envoy``: the client half-closes and at once cancels (what Envoy's close of a finished stream does);
* ``server-first-cancel``: the server returns after its last answer, the client cancels on reading it.

For each ending the server's RSS (from /proc) is sampled after a warm-up and again after
``--streams`` more streams; the growth is printed as bytes per stream. ``--loop uvloop`` runs the
server on uvloop; ``MALLOC_ARENA_MAX`` / ``--trim`` (``malloc_trim(0)`` via ctypes before each
sample) tell allocator fragmentation apart from memory still referenced.

    python bench/grpc_aio_leak.py [--streams 20000] [--endings halfclose,server-first,cancel]
                                  [--loop asyncio|uvloop] [--trim]

Measured here (grpcio 1.85.3, the only version the index offers; B per stream after a warm-up,
10,000-30,000 streams, noisy to ~+-20 B): ``halfclose`` 17-35 (8 with MALLOC_ARENA_MAX=2 and
``--trim``), ``server-first`` 17-38, ``cancel`` 143-173 (143 with ``--trim``: memory still referenced,
not fragmentation), ``envoy`` 89-136 (uvloop the same: 136), ``server-first-cancel`` 79. A stream the
client resets while the server waits in a read leaks; grpc/grpc#43360 names the cause (a batch
cancelled or failed never frees its native op array).

Talks only to 127.0.0.1; stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

_METHOD = "/leak.Echo/Stream"
_MESSAGES = 4  # per stream, each way: about what one small non-streamed request costs on ext_proc


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def _serve(port: int, ending: str) -> None:
    async def stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        answered = 0
        async for message in requests:
            yield message
            answered += 1
            if ending.startswith("server-first") and answered == _MESSAGES:
                return

    handler = grpc.method_handlers_generic_handler(
        "leak.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(stream)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def _server_main(port: int, ending: str, loop: str, trim: bool) -> None:
    if trim:
        libc = ctypes.CDLL("libc.so.6")
        signal.signal(signal.SIGUSR1, lambda *_: libc.malloc_trim(0))
    if loop == "uvloop":
        import uvloop

        uvloop.run(_serve(port, ending))
    else:
        asyncio.run(_serve(port, ending))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _drive(port: int, ending: str, count: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call_factory = channel.stream_stream(_METHOD)

        async def one() -> None:
            call = call_factory()
            for i in range(_MESSAGES):
                await call.write(b"x" * 200 + bytes([i]))
                await call.read()
            if ending in ("cancel", "server-first-cancel"):
                call.cancel()  # what Envoy does once it has the last answer it needs
                return
            if ending == "envoy":
                await call.done_writing()  # Envoy's close(): a half-close, then at once a reset
                call.cancel()
                return
            await call.done_writing()
            if await call.read() is not grpc.aio.EOF:
                raise RuntimeError("expected the end of the stream")
            await call.code()

        for start in range(0, count, 16):
            await asyncio.gather(*(one() for _ in range(min(16, count - start))))


def _measure(ending: str, args: argparse.Namespace) -> tuple[float, int, int]:
    port = _free_port()
    command = [sys.executable, __file__, "--serve", str(port), "--endings", ending, "--loop", args.loop]
    server = subprocess.Popen(command + (["--trim"] if args.trim else []), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()
        asyncio.run(_drive(port, ending, args.warmup))
        samples = []
        for _ in range(2):
            if args.trim:
                server.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            samples.append(_rss(server.pid))
            if len(samples) == 1:
                asyncio.run(_drive(port, ending, args.streams))
        return (samples[1] - samples[0]) / args.streams, samples[0], samples[1]
    finally:
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=3000)
    parser.add_argument("--endings", default="halfclose,server-first,cancel")
    parser.add_argument("--loop", default="asyncio", choices=("asyncio", "uvloop"))
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) in the server before each sample")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _server_main(args.serve, args.endings, args.loop, args.trim)
        return 0
    print(
        f"grpcio {grpc.__version__}, loop {args.loop}, trim {args.trim}, "
        f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', '')}, {args.streams} streams after {args.warmup}"
    )
    for ending in args.endings.split(","):
        per_stream, before, after = _measure(ending, args)
        print(f"{ending:13s} RSS {before / 2**20:7.1f} -> {after / 2**20:7.1f} MiB   {per_stream:8.1f} B/stream")
    return 0


if __name__ == "__main__":
    sys.exit(main())
