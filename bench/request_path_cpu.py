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

    python bench/request_path_cpu.py [--requests 20000] [--rounds 5] [--pods 2] [--profile]

Talks to nothing; stops by itself.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Iterable

import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.datalayer.datastore import Datastore
from epp.extproc.answers import FULL_DUPLEX
from epp.extproc.processor import ExternalProcessor
from epp.framework import Endpoint, Handle, Metrics, PluginMetrics
from epp.requestcontrol.director import Director
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.server.metrics import Metrics as PickerMetrics
from epp.wire._fast import StreamBase


class _Wire(StreamBase):
    """An ext_proc stream's wire side that keeps nothing: the answers are counted, the end noted."""

    def __init__(self) -> None:
        super().__init__()
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

    def echo_response_bodies(self) -> None:
        pass


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000, help="per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--prompt-bytes", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="also one round under cProfile: the top functions")
    args = parser.parse_args(argv)
    processor = _processor(args.pods)
    messages = _messages(args.prompt_bytes)
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
