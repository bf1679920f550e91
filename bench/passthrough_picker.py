"""The floor under any Python ext_proc: the same protocol answers as epp, with no work at all.

No parsing, no scheduling, no metrics: request bodies are held and echoed as epp does, every
request goes round robin over ``--endpoints``, response headers and chunks are echoed. Its CPU per
request is what grpc.aio + protobuf cost for the message pattern Envoy's reference configuration
produces, which tells how much of epp's cost is epp's own. Used by ``extproc_overhead.py --floor``;
not part of the product.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal

import grpc
import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp.extproc.answers import CONTINUE_RESPONSE_HEADERS, CONTINUE_RESPONSE_TRAILERS, streamed_body


def _destination_reply(hostport: str) -> pb.ProcessingResponse:
    reply = pb.ProcessingResponse()
    option = reply.request_headers.response.header_mutation.set_headers.add()
    option.header.key = "x-gateway-destination-endpoint"
    option.header.raw_value = hostport.encode()
    reply.request_headers.response.clear_route_cache = True
    return reply


class Passthrough(pb_grpc.ExternalProcessorServicer):
    def __init__(self, endpoints: list[str]) -> None:
        self._replies = itertools.cycle([_destination_reply(e) for e in endpoints])

    async def Process(self, request_iterator, context):  # type: ignore[no-untyped-def]
        chunks: list[bytes] = []
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_body":
                chunks.append(message.request_body.body)
                if message.request_body.end_of_stream:
                    yield next(self._replies)
                    body = b"".join(chunks)
                    for start in range(0, max(len(body), 1), 62_000):
                        yield streamed_body("request_body", body[start : start + 62_000], start + 62_000 >= len(body))
            elif kind == "request_headers" and message.request_headers.end_of_stream:
                yield next(self._replies)
            elif kind == "response_headers":
                yield CONTINUE_RESPONSE_HEADERS
            elif kind == "response_body":
                yield streamed_body("response_body", message.response_body.body, message.response_body.end_of_stream)
            elif kind == "response_trailers":
                yield CONTINUE_RESPONSE_TRAILERS


async def _serve(port: int, endpoints: list[str]) -> None:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_ExternalProcessorServicer_to_server(Passthrough(endpoints), server)
    checker = health.aio.HealthServicer()
    await checker.set("envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True, help="comma-separated ip:port")
    args = parser.parse_args()
    uvloop.run(_serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
