"""What one streamed response chunk costs the picker's own Python code: upb objects vs raw wire bytes.

    python bench/chunk_encoding.py [--chunks 20000] [--runs 7]

Issue 14 asked whether answering a response_body chunk by wire-encoding around its bytes (a generic
gRPC handler with identity (de)serializers, a few bytes of protobuf framing written by hand) would
cut the picker's CPU per chunk. This times, in one process, CPU time, medians of ``--runs``:

* ``upb``: what the picker does now per chunk, minus gRPC: parse the ProcessingRequest, ask which
  message it is, build the streamed_response answer (:func:`epp.extproc.answers.streamed_body`) and
  serialize it;
* ``raw``: the same in pure Python on bytes: read the two length prefixes, slice the chunk out, and
  write the five levels of framing around it.

Both give byte-identical answers (checked). On this machine both are ~3-4 µs per chunk, and raw is
not faster: the per-chunk cost the streaming bench sees (100-400 µs) is in gRPC's machinery (the
poller thread handing each message to the event loop, its wake-up writes, its sends), not in
protobuf. Talks to nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.extproc.answers import streamed_body

_CHUNK = b'data: {"id":"cmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(payload)) + payload


def _read_len(data: bytes, at: int) -> tuple[int, int]:
    """A varint length at ``at``: (the length, where its payload starts)."""
    n = shift = 0
    while True:
        byte = data[at]
        n |= (byte & 0x7F) << shift
        at += 1
        shift += 7
        if byte < 0x80:
            return n, at


def _upb(wire: bytes) -> bytes:
    message = pb.ProcessingRequest.FromString(wire)
    message.WhichOneof("request")
    body = message.response_body
    return streamed_body("response_body", body.body, body.end_of_stream).SerializeToString()


def _raw(wire: bytes) -> bytes:
    # ProcessingRequest.response_body is field 5; HttpBody.body field 1 (end_of_stream false: absent).
    length, start = _read_len(wire, 1)
    inner = wire[start : start + length]
    length, start = _read_len(inner, 1)
    chunk = inner[start : start + length]
    # ProcessingResponse.response_body(4) > BodyResponse.response(1) > CommonResponse.body_mutation(3)
    # > BodyMutation.streamed_response(3) > StreamedBodyResponse.body(1)
    return _field(0x22, _field(0x0A, _field(0x1A, _field(0x1A, _field(0x0A, chunk)))))


def _time(encode: Callable[[bytes], bytes], wire: bytes, chunks: int, runs: int) -> float:
    per_run = []
    for _ in range(runs):
        start = time.process_time()
        for _ in range(chunks):
            encode(wire)
        per_run.append((time.process_time() - start) / chunks * 1e6)
    return statistics.median(per_run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    request = pb.ProcessingRequest()
    request.response_body.body = _CHUNK
    wire = request.SerializeToString()
    if _raw(wire) != _upb(wire):
        print("the raw answer differs from upb's", file=sys.stderr)
        return 1
    print(f"{len(_CHUNK)} B SSE chunk; CPU µs per chunk, median of {args.runs} runs of {args.chunks}")
    for name, encode in (("upb", _upb), ("raw", _raw)):
        print(f"  {name}: {_time(encode, wire, args.chunks, args.runs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
