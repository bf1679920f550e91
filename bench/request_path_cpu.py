"""The picker's own Python work per request, without the wire: what epp adds to the protocol's floor.

``extproc_overhead.py --floor`` measures, through Envoy, the picker and a no-work ext_proc server on
the same transport side by side; the difference is epp's own work (parsing, routing, accounting,
metrics). This bench measures that work alone, in one process with no sockets, so it can be
profiled: the default configuration (as the picker builds it with no config file) over a static pool
of ``--pods`` idle pods, and for each request the messages Envoy's reference configuration sends for
a non-streamed completion (request headers with the processing modes, the body in one message,
response headers, the response body with its usage), answered by :class:`ExternalProcessor` into an
in-memory stream. CPU per request is the process's CPU time over a round, divided by its requests;
the table shows each round and the median. ``--profile`` adds cProfile's top functions (cProfile
slows small functions more than large ones: read it for where, not how much).

    python bench/request_path_cpu.py [--requests 20000] [--rounds 5] [--pods 2] [--profile] [--wire]

``--wire`` drives the same messages through a real :class:`epp.wire.http2.Connection` over an
in-memory transport, as Envoy's bytes arrive at one connection with one request at a time (the
request's headers and body in one read, the response's headers and body in the next), and splits
each read's time at its one write: *before the write* is what Envoy waits for (the request's
latency at one connection), *after* is what the picker does once its answers are out. The thread's
CPU time (its clock read at the read's start, at its first write and at its end), medians per read
over the rounds.

Talks to nothing; stops by itself.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import struct
import time
from collections.abc import Callable, Iterable

import hpack
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.datalayer.datastore import Datastore
from epp.extproc.answers import FULL_DUPLEX
from epp.extproc.processor import METHOD, ExternalProcessor
from epp.framework import Endpoint, Handle, Metrics, PluginMetrics
from epp.requestcontrol.director import Director
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.server.metrics import Metrics as PickerMetrics
from epp.wire._fast import StreamBase
from epp.wire.http2 import Connection


class _Wire(StreamBase):
    """An ext_proc stream's wire side that keeps nothing: the answers are counted, the end noted."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: dict[bytes, bytes] = {}  # the gRPC request metadata: none
        self.answers = 0
        self.ended = False

    def send(self, message: bytes) -> None:
        self.answers += 1

    def send_all(self, messages: Iterable[bytes], *, end: bool = False) -> None:
        for _ in messages:
            self.answers += 1
        self.ended = self.ended or end

    def finish(self, status: int = 0, message: str = "") -> None:
        self.ended = True

    def echo_response_bodies(self, *, observed: bool = False) -> None:
        pass

    def idle(self) -> None:
        pass

    def after_write(self, work: Callable[[], object]) -> None:
        work()  # (nothing waits to be written here)


def _headers(pairs: list[tuple[str, str]], into: object) -> None:
    for key, value in pairs:
        header = into.headers.add()  # type: ignore[attr-defined]
        header.key = key
        header.raw_value = value.encode()


def _messages(prompt_bytes: int) -> list[bytes]:
    """What Envoy sends for one non-streamed completion of a ``prompt_bytes`` prompt."""
    words = ("the quick brown fox jumps over the lazy dog " * (prompt_bytes // 44 + 1))[:prompt_bytes]
    body = json.dumps({"model": "bench-model", "prompt": words, "max_tokens": 16}).encode()
    headers = pb.ProcessingRequest()
    _headers(
        [(":method", "POST"), (":path", "/v1/completions"), (":authority", "127.0.0.1:10000"), (":scheme", "http"),
         ("content-type", "application/json"), ("content-length", str(len(body))), ("user-agent", "wrk"),
         ("x-request-id", "3f0c1c5e-1f1a-4b52-9a55-0f6f1a1f2b3c"), ("x-forwarded-proto", "http")],
        headers.request_headers.headers,
    )  # fmt: skip
    headers.protocol_config.request_body_mode = FULL_DUPLEX
    headers.protocol_config.response_body_mode = FULL_DUPLEX
    request_body = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    response_headers = pb.ProcessingRequest()
    _headers(
        [(":status", "200"), ("content-type", "application/json"), ("content-length", "190"),
         ("date", "Fri, 04 Dec 2026 10:00:00 GMT")],
        response_headers.response_headers.headers,
    )  # fmt: skip
    reply = {"id": "cmpl-1", "object": "text_completion", "model": "bench-model",
             "choices": [{"index": 0, "text": " jumps" * 16, "finish_reason": "length"}],
             "usage": {"prompt_tokens": prompt_bytes // 4, "completion_tokens": 16, "total_tokens": prompt_bytes // 4 + 16}}  # fmt: skip
    response_body = pb.ProcessingRequest(response_body=pb.HttpBody(body=json.dumps(reply).encode(), end_of_stream=True))
    return [m.SerializeToString() for m in (headers, request_body, response_headers, response_body)]


def _processor(pods: int) -> ExternalProcessor:
    now = time.monotonic()
    endpoints = [
        Endpoint(f"pod-{i}", "127.0.0.1", 9000 + i,
                 metrics=Metrics(kv_cache_usage=0.1, num_gpu_blocks=16384, block_size=16, updated_at=now, stale=False))
        for i in range(pods)
    ]  # fmt: skip
    datastore = Datastore(endpoints)
    metrics = PickerMetrics()
    config = load_config(
        None, default_registry(), Handle(datastore, metrics=PluginMetrics(metrics.registry)), metrics=metrics.plugins
    )
    director = Director(datastore, config.scheduler, metrics.requests)
    return ExternalProcessor(director, metrics.requests, max_request_body_bytes=16 << 20)


async def _serve(processor: ExternalProcessor, messages: list[bytes], count: int) -> None:
    headers, body, response_headers, response_body = messages
    for _ in range(count):
        wire = _Wire()
        call = processor.open(wire)  # type: ignore[arg-type]
        call.message(headers)
        call.message(body)  # the whole request: routed by a task, as on the wire
        task = call._task
        if task is not None:
            await task
        call.message(response_headers)
        call.message(response_body)
        if not wire.ended:
            raise RuntimeError("the stream did not end: the message sequence is not what the picker expects")


class _Transport:
    """A connection's transport, in memory: the time of each read's first write."""

    def __init__(self) -> None:
        self.written_at = 0

    def write(self, data: bytes) -> None:
        if not self.written_at:
            self.written_at = time.thread_time_ns()

    def writelines(self, pieces: Iterable[bytes]) -> None:
        self.write(b"")

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + stream_id.to_bytes(4) + payload


def _grpc(stream_id: int, message: bytes) -> bytes:
    return _frame(0, 0, stream_id, b"\0" + len(message).to_bytes(4) + message)  # DATA


async def _serve_wire(processor: ExternalProcessor, messages: list[bytes], count: int, first_stream: int) -> list[list[int]]:
    """``count`` requests through a real connection; per read: [ns before its write, ns after it]."""
    headers, body, response_headers, response_body = messages
    connection = Connection(processor.methods(), max_message=16 << 20)
    transport = _Transport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    encoder = hpack.Encoder()
    connection.data_received(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b""))  # preface, SETTINGS
    # As Envoy 1.40 sends them: :path a literal never put in the table, so every stream's block is the same
    # block of table references and one Huffman-coded literal.
    open_stream = [(":method", "POST"), hpack.NeverIndexedHeaderTuple(":path", METHOD), (":authority", "epp"),
                   (":scheme", "http"), ("te", "trailers"), ("content-type", "application/grpc"),
                   ("x-envoy-internal", "true"), ("x-forwarded-for", "192.0.2.2")]  # fmt: skip
    reads: list[list[int]] = [[], [], [], []]
    for i in range(count):
        if connection.window < 1 << 20:  # Envoy opens its receive window as the answers use it
            connection.data_received(_frame(8, 0, 0, (2**31 - 1 - connection.window).to_bytes(4)))
        stream_id = first_stream + 2 * i
        request = _frame(1, 4, stream_id, encoder.encode(open_stream)) + _grpc(stream_id, headers) + _grpc(stream_id, body)
        for read, data in enumerate((request, _grpc(stream_id, response_headers) + _grpc(stream_id, response_body))):
            transport.written_at = 0
            started = time.thread_time_ns()
            connection.data_received(data)
            ended = time.thread_time_ns()
            if not transport.written_at:
                raise RuntimeError("a read was not answered: the message sequence is not what the picker expects")
            reads[2 * read].append(transport.written_at - started)
            reads[2 * read + 1].append(ended - transport.written_at)
    return reads


def _wire_rounds(processor: ExternalProcessor, messages: list[bytes], requests: int, rounds: int) -> None:
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(_serve_wire(processor, messages, min(2000, requests), 1))  # warm-up
        medians: list[list[float]] = [[], [], [], []]
        for _ in range(rounds):
            reads = loop.run_until_complete(_serve_wire(processor, messages, requests, 1))
            for kind, times in enumerate(reads):
                medians[kind].append(statistics.median(times) / 1000)
    finally:
        loop.close()
    print(f"through a real connection in memory, one request at a time, {requests} requests a round, µs a read "
          "(median of the rounds' medians):")  # fmt: skip
    for name, before, after in (("request (headers + body)", medians[0], medians[1]),
                                ("response (headers + body)", medians[2], medians[3])):  # fmt: skip
        print(f"  {name:26}  before its write {statistics.median(before):6.1f}   after it {statistics.median(after):6.1f}"
              f"   (rounds before: {', '.join(f'{v:.1f}' for v in before)})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="also one round under cProfile: the top functions")
    parser.add_argument("--wire", action="store_true", help="through a real connection: each read's time before and after its write")
    args = parser.parse_args(argv)
    processor = _processor(args.pods)
    messages = _messages(args.prompt_bytes)
    if args.wire:
        _wire_rounds(processor, messages, args.requests, args.rounds)
        return 0
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(_serve(processor, messages, min(2000, args.requests)))  # warm-up
        rounds = []
        for _ in range(args.rounds):
            started = time.process_time()
            loop.run_until_complete(_serve(processor, messages, args.requests))
            rounds.append((time.process_time() - started) / args.requests * 1e6)
        print(f"default configuration, {args.pods} pods, {args.prompt_bytes}-byte prompts, {args.requests} requests a round")
        print(f"picker CPU per request, no wire: {statistics.median(rounds):.1f} µs (rounds: "
              + ", ".join(f"{r:.1f}" for r in rounds) + ")")  # fmt: skip
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            loop.run_until_complete(_serve(processor, messages, args.requests))
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
