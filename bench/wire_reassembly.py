"""What a large gRPC message costs epp.wire's connection to read and to send, split into HTTP/2 frames.

    python bench/wire_reassembly.py [--sizes 1,4,16,64] [--frame 16384] [--runs 5]

A message over the frame size arrives, and leaves, in many DATA frames (Envoy sends 16 KiB frames
unless told otherwise; a BUFFERED request body is one message of up to the body limit, 16 MiB by
default). Reading such a message must cost its size, not its size squared: each frame appended in
place, never the whole message copied again per frame. The same for sending one through a peer's
frame size. This drives one :class:`epp.wire.http2.Connection` in memory (no socket), a frame per
read as a socket would deliver them, and prints the median CPU milliseconds of ``--runs`` for each
size, and per MiB: flat across sizes when linear.

Measured here (2 shared cores; medians of 3 runs, 1 for 64 MiB before), before the fix (each frame
copied the message so far, on both sides) and after::

    size     read ms, before -> after    send ms, before -> after
    1 MiB          3.9 -> 2.5                  2.3 -> 0.8
    4 MiB         53.6 -> 9.3                 45.2 -> 3.3
    16 MiB       1,232 -> 34                   921 -> 23
    64 MiB      84,178 -> 140               43,933 -> 90

(before: the same script with ``PYTHONPATH`` at a copy of epp whose http2.py is the previous one.)

Talks to nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import time
from collections.abc import Iterable
from typing import Any

from epp.wire.http2 import Connection, Stream

_PATH = "/bench.Echo/Echo"


class _Transport:
    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)

    def writelines(self, pieces: Iterable[bytes]) -> None:
        for piece in pieces:
            self.bytes += len(piece)

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default


class _Keep:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.size = 0

    def message(self, data: bytes) -> None:
        self.size = len(data)

    def half_close(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | kind, flags, stream_id) + payload


def _connection(calls: list[_Keep]) -> tuple[Connection, _Transport]:
    connection = Connection({_PATH: lambda s: calls.append(_Keep(s)) or calls[-1]}, max_message=1 << 31)
    transport = _Transport()
    connection.connection_made(transport)
    settings = struct.pack(">HIHI", 4, 2**31 - 1, 5, 16_384)  # the peer's windows wide open, 16 KiB frames
    window = _frame(8, 0, 0, struct.pack(">I", 2**31 - 1 - 65_535))
    # A request's header block: literal fields without indexing.
    block = b"".join(
        b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value
        for name, value in ((b":method", b"POST"), (b":path", _PATH.encode()), (b"content-type", b"application/grpc"))
    )
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    connection.data_received(preface + _frame(4, 0, 0, settings) + window + _frame(1, 4, 1, block))
    return connection, transport


async def _read(size: int, frame: int) -> float:
    calls: list[_Keep] = []
    connection, _ = _connection(calls)
    message = struct.pack(">BI", 0, size) + bytes(size)
    frames = [_frame(0, 0, 1, message[i : i + frame]) for i in range(0, len(message), frame)]
    start = time.process_time()
    for item in frames:
        connection.data_received(item)
    elapsed = time.process_time() - start
    assert calls[0].size == size
    return elapsed


async def _send(size: int) -> float:
    calls: list[_Keep] = []
    _, transport = _connection(calls)
    stream = calls[0].stream
    message = bytes(size)
    start = time.process_time()
    stream.send(message)
    elapsed = time.process_time() - start
    await asyncio.sleep(0)  # the write
    assert transport.bytes > size
    return elapsed


async def _main(args: argparse.Namespace) -> None:
    print(f"{'size':>8} {'read ms':>9} {'per MiB':>8} {'send ms':>9} {'per MiB':>8}")
    for mib in (int(s) for s in args.sizes.split(",")):
        size = mib << 20
        reads, sends = [], []
        for _ in range(args.runs):  # alternated, one of each per round
            reads.append(await _read(size, args.frame))
            sends.append(await _send(size))
        read, send = statistics.median(reads) * 1000, statistics.median(sends) * 1000
        print(f"{mib:>5} MiB {read:>9.1f} {read / mib:>8.2f} {send:>9.1f} {send / mib:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="message sizes, MiB, comma-separated")
    parser.add_argument("--frame", type=int, default=16_384, help="DATA frame payload size of the reads")
    parser.add_argument("--runs", type=int, default=5)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
