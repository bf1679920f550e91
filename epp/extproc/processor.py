"""The one module that speaks Envoy's ext_proc protocol (``envoy.service.ext_proc.v3.ExternalProcessor``).

Design
------
Each HTTP request is one bidirectional gRPC stream. With the reference Envoy configuration
(header modes SEND, body modes FULL_DUPLEX_STREAMED, trailer modes SEND) a stream runs::

    Envoy -> picker                    picker -> Envoy
    request_headers (eos=false)        (held: the pick needs the body)
    request_body ... (eos=true)        request_headers: set x-gateway-destination-endpoint,
                                         clear_route_cache, dynamic_metadata envoy.lb
                                       request_body: streamed_response chunks of <= 62,000 bytes
    response_headers                   response_headers: continue
    response_body ... (each chunk)     response_body: streamed_response, the chunk unchanged
    response_trailers (if any)         response_trailers: continue

Body-less requests (``request_headers`` with end_of_stream, e.g. ``GET /v1/models``) are routed
at once. Envoy announces its body modes in the first message (``protocol_config``); with BUFFERED
request bodies it waits for the headers answer before sending the body, so the picker answers the
headers with "continue" and sets the destination on the (single, whole) body message instead.
Response bodies are answered per chunk as they come, never buffered, so SSE streams token by token.

Errors: anything on the request path raises :class:`epp.errors.EppError`; this module alone turns
it into an ImmediateResponse (status and OpenAI-style JSON body from :func:`epp.errors.http_answer`,
plus the error's own response headers, such as ``x-llm-d-request-dropped-reason``) and ends the
stream. An unexpected exception becomes a 500 for that request only and is logged.

Security: the picker overwrites ``x-gateway-destination-endpoint`` and removes every other
client-sent ``x-gateway-destination-endpoint*`` header; it only ever names pool members. (The
Envoy configs in deploy/ also strip the header before ext_proc, for when the picker is down.)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Mapping

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from epp.requestcontrol.director import Director, Routing
from epp.errors import EppError, Reason, http_answer
from epp.server.metrics import Metrics
from epp.extproc.parsing import parse_request

__all__ = [
    "DESTINATION_HEADER",
    "MAX_STREAMED_CHUNK",
    "ExternalProcessor",
    "SUBSET_HINT_KEY",
    "SUBSET_HINT_NAMESPACE",
]

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# The upstream picker streams bodies back in pieces of at most this size; Envoy's default buffer
# limits (64 KiB) sit just above it.
MAX_STREAMED_CHUNK = 62_000

_Mode = processing_mode_pb2.ProcessingMode
_FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
_BUFFERED = _Mode.BUFFERED
_NONE = _Mode.NONE
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Constant answers, built once.
_CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_JSON_CONTENT_TYPE = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_OVERWRITE
)


def _streamed_request_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
                )
            )
        )
    )


def _streamed_response_body(chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        response_body=pb.BodyResponse(
            response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(
                    streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
                )
            )
        )
    )


_END_OF_REQUEST_BODY = _streamed_request_body(b"", True)
_END_OF_RESPONSE_BODY = _streamed_response_body(b"", True)
# (phase, destination) -> the routing answer; bounded, since fallback lists make combinations.
_ANSWERS: dict[tuple[str, str], pb.ProcessingResponse] = {}
_MAX_CACHED_ANSWERS = 4096


def _response_headers_answer(added: Mapping[str, str]) -> pb.ProcessingResponse:
    """Continue the response with the headers plugins asked to set on it."""
    mutation = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
            )
            for key, value in added.items()
        ]
    )
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation)))


def _header_option(item: tuple[str, str]) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=item[0], raw_value=item[1].encode()), append_action=_OVERWRITE
    )


def _immediate(error: EppError) -> pb.ProcessingResponse:
    status, body = http_answer(error)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_JSON_CONTENT_TYPE, *map(_header_option, error.headers.items())]),
            body=body,
            details=f"epp_{error.reason.value}",
        )
    )


def _routing_answer(routing: Routing, client_headers: Iterable[str], phase: str) -> pb.ProcessingResponse:
    """The answer (to ``phase``: request_headers, or request_body in BUFFERED mode) that sends the
    request to ``routing``'s pick: the destination header, the same value as ``envoy.lb`` metadata,
    clear_route_cache, and the removal of forged control headers.

    Without forged headers the answer depends only on the destination, and a pool has few of those:
    such answers are built once and reused.
    """
    forged = [name for name in client_headers if name.startswith(DESTINATION_HEADER) and name != DESTINATION_HEADER]
    destination = routing.destination
    if not forged:
        cached = _ANSWERS.get((phase, destination))
        if cached is not None:
            return cached
    mutation = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
                append_action=_OVERWRITE,
            )
        ],
        # Forged control headers (…-subset, …-served, …-fallback): only the picker speaks them.
        remove_headers=forged,
    )
    answer = pb.ProcessingResponse()
    getattr(answer, phase).response.CopyFrom(pb.CommonResponse(header_mutation=mutation, clear_route_cache=True))
    answer.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    if not forged:
        if len(_ANSWERS) >= _MAX_CACHED_ANSWERS:
            _ANSWERS.clear()
        _ANSWERS[(phase, destination)] = answer
    return answer


def _subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """The gateway's subset hint from the stream's metadata, or None when there is none.

    The protocol puts a list of ``ip:port`` strings there; a single comma-separated string is
    accepted too.
    """
    if not request.HasField("metadata_context"):
        return None
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_HINT_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_HINT_NAMESPACE].fields
    if SUBSET_HINT_KEY not in fields:
        return None
    value = fields[SUBSET_HINT_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [item.string_value.strip() for item in value.list_value.values if item.string_value.strip()]
    if kind == "string_value":
        return [item.strip() for item in value.string_value.split(",") if item.strip()]
    return []


def _headers(message: pb.HttpHeaders) -> dict[str, str]:
    # Envoy fills raw_value (bytes); older versions and hand-written clients use value.
    return {
        h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in message.headers.headers
    }


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` backed by a :class:`epp.requestcontrol.director.Director`."""

    def __init__(self, director: Director, metrics: Metrics, *, max_request_body_bytes: int) -> None:
        self._director = director
        self._metrics = metrics
        self._max_body = max_request_body_bytes

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        request_mode = _FULL_DUPLEX
        response_mode = _FULL_DUPLEX
        headers: dict[str, str] = {}
        subset: list[str] | None = None
        chunks: list[bytes] = []
        size = 0
        routing: Routing | None = None
        request_done = False  # the request phase has been answered (routed)
        outcome = "cancelled"
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    if message.HasField("protocol_config"):
                        request_mode = message.protocol_config.request_body_mode
                        response_mode = message.protocol_config.response_body_mode
                    headers = _headers(message.request_headers)
                    subset = _subset_hint(message)
                    if message.request_headers.end_of_stream or request_mode == _NONE:
                        routing = await self._route(headers, b"", subset)
                        request_done = True
                        yield _routing_answer(routing, headers, "request_headers")
                    elif request_mode == _BUFFERED:
                        yield _CONTINUE_REQUEST_HEADERS
                    elif request_mode != _FULL_DUPLEX:
                        raise EppError(
                            Reason.UNSUPPORTED,
                            f"the gateway sends request bodies in {_Mode.BodySendMode.Name(request_mode)} mode; "
                            "the endpoint picker needs FULL_DUPLEX_STREAMED (or BUFFERED)",
                        )

                elif kind == "request_body":
                    body = message.request_body
                    if request_done:
                        raise RuntimeError("Envoy sent request body after the request was routed")
                    if body.body:
                        size += len(body.body)
                        if size > self._max_body:
                            raise EppError(
                                Reason.BODY_TOO_LARGE,
                                f"request body exceeds the limit of {self._max_body} bytes (--max-request-body-bytes)",
                            )
                        chunks.append(body.body)
                    if body.end_of_stream:
                        whole = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                        chunks = []
                        routing = await self._route(headers, whole, subset)
                        request_done = True
                        for response in self._request_answer(routing, headers, request_mode, whole, True):
                            yield response

                elif kind == "request_trailers":
                    if not request_done:  # trailers end a body that had no end_of_stream
                        whole = b"".join(chunks)
                        chunks = []
                        routing = await self._route(headers, whole, subset)
                        request_done = True
                        for response in self._request_answer(routing, headers, request_mode, whole, False):
                            yield response
                    yield _CONTINUE_REQUEST_TRAILERS

                elif kind == "response_headers":
                    added = routing.response_headers(_headers(message.response_headers)) if routing is not None else None
                    yield _response_headers_answer(added) if added else _CONTINUE_RESPONSE_HEADERS
                    if message.response_headers.end_of_stream:
                        outcome = "complete"

                elif kind == "response_body":
                    body = message.response_body
                    if routing is not None and body.body:
                        routing.response_body_started()
                    if response_mode == _FULL_DUPLEX:
                        chunk = body.body
                        if chunk or not body.end_of_stream:
                            yield _streamed_response_body(chunk, body.end_of_stream)
                        else:  # the usual last message: nothing but end_of_stream
                            yield _END_OF_RESPONSE_BODY
                    else:
                        yield _CONTINUE_RESPONSE_BODY
                    if body.end_of_stream:
                        outcome = "complete"

                elif kind == "response_trailers":
                    yield _CONTINUE_RESPONSE_TRAILERS
                    outcome = "complete"
            if outcome != "complete" and request_done:
                outcome = "complete"  # Envoy closed the stream cleanly after the request phase
        except EppError as error:
            outcome = "error"
            if request_done:
                raise  # too late for an HTTP answer: fail the stream
            self._count_error(error)
            yield _immediate(error)
        except Exception:
            outcome = "error"
            if request_done:
                raise
            log.exception("unexpected error while processing request %s", headers.get("x-request-id", "?"))
            error = EppError(Reason.INTERNAL, "internal error in the endpoint picker")
            self._count_error(error)
            yield _immediate(error)
        finally:
            if routing is not None:
                routing.finish(outcome)

    async def _route(self, headers: dict[str, str], body: bytes, subset: list[str] | None) -> Routing:
        request = parse_request(headers, body, base_models=self._director.base_models)
        routing = await self._director.route(request, subset)
        per_model = self._metrics.for_model(request.model)
        per_model.requests.inc()
        self._metrics.routed.inc()
        if body:
            per_model.sizes.observe(len(body))
        return routing

    def _request_answer(
        self, routing: Routing, headers: dict[str, str], mode: int, body: bytes, end_of_stream: bool
    ) -> Iterable[pb.ProcessingResponse]:
        """The answers that release a complete request body to ``routing``'s pick."""
        if mode == _BUFFERED:
            # Envoy already has its headers answer; in BUFFERED mode the body answer may still
            # mutate the request headers, and the body itself goes on unchanged.
            yield _routing_answer(routing, headers, "request_body")
            return
        yield _routing_answer(routing, headers, "request_headers")
        size = len(body)
        if size <= MAX_STREAMED_CHUNK:
            if size:
                yield _streamed_request_body(body, end_of_stream)
            elif end_of_stream:
                yield _END_OF_REQUEST_BODY
            return
        view = memoryview(body)
        for start in range(0, size, MAX_STREAMED_CHUNK):
            end = start + MAX_STREAMED_CHUNK
            yield _streamed_request_body(bytes(view[start:end]), end_of_stream and end >= size)

    def _count_error(self, error: EppError) -> None:
        self._metrics.request_outcome_total.labels(error.reason.value).inc()
        # No model label: the body, where the model is named, may be what is wrong.
        self._metrics.request_error_total.labels("", "", error.reason.value).inc()
