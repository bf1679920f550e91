"""The picker's CPU per request with tracing off and on, in-process (no gRPC, no Envoy).

Each request is the ext_proc conversation of a streamed completion, fed straight to the picker's
``ExternalProcessor.Process``: request headers, the body (end of stream), response headers, 32 SSE
chunks and the end of the response. The picker is the real one (static pool of 4 endpoints, the
default profile, scraping off). Modes, run alternately for several rounds, medians printed:

* ``off``: ``--tracing=false`` (the default);
* ``on``: a tracer sampling every request (``OTEL_TRACES_SAMPLER=always_on``), spans exported
  over OTLP/gRPC to a collector in a child process (so the SDK's export thread is counted, the
  collector is not);
* ``on10``: the same with upstream's default sampler (parent-based, 10% of new traces).

``--modes off`` runs on a tree without tracing too (compare a checkout from before it:
``PYTHONPATH=OLD_TREE python bench/tracing_cost.py --modes off``). CPU is this process's
``time.process_time()`` (every thread), divided by the requests.

Run: ``python bench/tracing_cost.py [--requests 2000] [--rounds 5]``; talks only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

_COLLECTOR = """
import grpc, sys, time
from concurrent import futures
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as m, trace_service_pb2_grpc as g
class C(g.TraceServiceServicer):
    def Export(self, request, context):
        return m.ExportTraceServiceResponse()
server = grpc.server(futures.ThreadPoolExecutor(2))
g.add_TraceServiceServicer_to_server(C(), server)
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
sys.stdin.read()
"""


def _messages(i: int) -> list[pb.ProcessingRequest]:
    headers = pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
                base_pb2.HeaderValue(key="x-request-id", raw_value=f"bench-{i}".encode()),
            ]
        )
    )
    body = json.dumps({"model": "m", "prompt": f"hello {i % 50} " * 40, "stream": True}).encode()
    out = [
        pb.ProcessingRequest(request_headers=headers),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[
                        base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                        base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
                    ]
                )
            )
        ),
    ]
    chunk = b'data: {"choices":[{"text":"tok "}]}\n\n'
    out += [pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)) for _ in range(32)]
    out.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True)))
    return out


async def _feed(messages: list[pb.ProcessingRequest]) -> AsyncIterator[pb.ProcessingRequest]:
    for message in messages:
        yield message


async def _round(processor: object, requests: int, conversations: list[list[pb.ProcessingRequest]]) -> float:
    started = time.process_time()
    for i in range(requests):
        async for _ in processor.Process(_feed(conversations[i % len(conversations)]), None):  # type: ignore[attr-defined]
            pass
    return (time.process_time() - started) / requests


async def _main(args: argparse.Namespace) -> None:
    from epp.datalayer.static import parse_endpoints
    from epp.server.server import EndpointPicker
    from epp.server.settings import Settings

    endpoints = ",".join(f"127.0.0.1:{8000 + i}" for i in range(4))
    picker = EndpointPicker(Settings(endpoints=tuple(parse_endpoints(endpoints)), scrape_metrics=False))
    processor = picker.processor
    conversations = [_messages(i) for i in range(200)]
    collector = None
    tracers: dict[str, object] = {}
    if {"on", "on10"} & set(args.modes):
        collector = subprocess.Popen([sys.executable, "-c", _COLLECTOR], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert collector.stdout is not None
        port = int(collector.stdout.readline())
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{port}"
        from epp.requestcontrol.tracing import Tracing

        tracers["on"] = Tracing({**os.environ, "OTEL_TRACES_SAMPLER": "always_on"})
        tracers["on10"] = Tracing({**os.environ, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio"})
    results: dict[str, list[float]] = {mode: [] for mode in args.modes}
    try:
        await _round(processor, 200, conversations)  # warm-up
        for _ in range(args.rounds):
            for mode in args.modes:
                picker.director.tracing = tracers.get(mode)  # type: ignore[assignment]
                results[mode].append(await _round(processor, args.requests, conversations))
    finally:
        for tracing in tracers.values():
            tracing.shutdown()  # type: ignore[attr-defined]
        if collector is not None:
            collector.kill()
            collector.wait()
    base = statistics.median(results[args.modes[0]])
    print(f"{'mode':6} {'CPU µs/request (median of ' + str(args.rounds) + ')':>34} {'ratio':>7}  rounds")
    for mode, values in results.items():
        median = statistics.median(values)
        rounds = " ".join(f"{v * 1e6:.0f}" for v in values)
        print(f"{mode:6} {median * 1e6:34.1f} {median / base:7.3f}  {rounds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["off", "on", "on10"], choices=["off", "on", "on10"])
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
