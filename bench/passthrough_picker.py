"""The floor under epp's request path: the same ext_proc exchange on the same transport, with no work.

No parsing, no scheduling, no metrics: request bodies are held and echoed as epp does, every
request goes round robin over ``--endpoints``, response headers are continued and response body
chunks echoed (in C from the first chunk on, as epp's streams are: ``Stream.echo_response_bodies``),
and the stream is ended once the response's last answer is sent, as epp ends it. It is served by
:mod:`epp.wire` (epp's own gRPC server, the I/O thread off), so its CPU per request and the latency
it adds are what the protocol's message pattern costs on this transport, which tells how much of
epp's cost is epp's own. Used by ``extproc_overhead.py --floor``; not part of the product.

(Until epp served ext_proc itself this floor was a grpc.aio servicer; what grpc.aio cost is in
``epp/extproc/processor.py``, "Transport".)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal

import uvloop
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc.answers import CONTINUE_RESPONSE_HEADERS, CONTINUE_RESPONSE_TRAILERS, streamed_body
from epp.extproc.processor import METHOD
from epp.server.server import EXT_PROC_SERVICE
from epp.wire.health import SERVING, Health
from epp.wire.http2 import Stream
from epp.wire.server import GrpcServer, bind_socket

_CHUNK = 62_000  # epp's largest streamed body mutation


def _destination_reply(hostport: str) -> bytes:
    reply = pb.ProcessingResponse()
    option = reply.request_headers.response.header_mutation.set_headers.add()
    option.header.key = "x-gateway-destination-endpoint"
    option.header.raw_value = hostport.encode()
    reply.request_headers.response.clear_route_cache = True
    return reply.SerializeToString()


_CONTINUE_HEADERS = CONTINUE_RESPONSE_HEADERS.SerializeToString()
_CONTINUE_TRAILERS = CONTINUE_RESPONSE_TRAILERS.SerializeToString()


class _Passthrough:
    """One ext_proc stream: every message answered at once, in the connection's read."""

    __slots__ = ("_chunks", "_replies", "_wire")

    def __init__(self, wire: Stream, replies: itertools.cycle[bytes]) -> None:
        self._wire = wire
        self._replies = replies
        self._chunks: list[bytes] = []

    def message(self, data: bytes) -> None:
        message = pb.ProcessingRequest.FromString(data)
        kind = message.WhichOneof("request")
        wire = self._wire
        send = wire.send
        if kind == "response_body":
            body = message.response_body
            if body.body:
                if not wire.response_bytes:  # the first chunk: the rest up to the last are echoed in C
                    wire.echo_response_bodies()
                wire.tally(body.body)
            send(streamed_body("response_body", body.body, body.end_of_stream).SerializeToString())
            if body.end_of_stream:
                wire.finish()
        elif kind == "request_body":
            self._chunks.append(message.request_body.body)
            if message.request_body.end_of_stream:
                send(next(self._replies))
                body = b"".join(self._chunks)
                for start in range(0, max(len(body), 1), _CHUNK):
                    last = start + _CHUNK >= len(body)
                    send(streamed_body("request_body", body[start : start + _CHUNK], last).SerializeToString())
        elif kind == "request_headers":
            if message.request_headers.end_of_stream:
                send(next(self._replies))
        elif kind == "response_headers":
            send(_CONTINUE_HEADERS)
            if message.response_headers.end_of_stream:
                wire.finish()
        elif kind == "response_trailers":
            send(_CONTINUE_TRAILERS)
            wire.finish()

    def half_close(self) -> None:
        self._wire.finish()

    def cancel(self) -> None:
        pass


async def _serve(port: int, endpoints: list[str]) -> None:
    replies = itertools.cycle([_destination_reply(e) for e in endpoints])
    health = Health()
    health.set(EXT_PROC_SERVICE, SERVING)
    health.set("", SERVING)
    server = GrpcServer(
        {METHOD: lambda wire: _Passthrough(wire, replies), **health.methods()}, io_thread=False, flag="--port"
    )
    server.serve_socket(bind_socket("127.0.0.1", port))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    health.stop()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--endpoints", required=True, help="comma-separated ip:port")
    args = parser.parse_args()
    uvloop.run(_serve(args.port, args.endpoints.split(",")))


if __name__ == "__main__":
    main()
