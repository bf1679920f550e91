"""The ext_proc messages the picker answers with, built once where they do not vary.

Each answer is an ``envoy.service.ext_proc.v3.ProcessingResponse``: continue a phase, carry a
(streamed) body chunk, route the request to its pick (the destination header, the same value as
``envoy.lb`` dynamic metadata, clear_route_cache, forged control headers removed), or refuse it with
an ImmediateResponse. The routing answer depends only on the destination when the client forged no
header, and a pool has few destinations: such answers are built once and reused (bounded).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2

from epp.envoy.bootstrap import OBSERVE_NAMESPACE
from epp.errors import EppError, http_answer
from epp.requestcontrol.lifecycle import RoutedRequest

__all__ = [
    "BUFFERED",
    "CONTINUE_REQUEST_BODY",
    "CONTINUE_REQUEST_HEADERS",
    "CONTINUE_REQUEST_TRAILERS",
    "CONTINUE_RESPONSE_BODY",
    "CONTINUE_RESPONSE_HEADERS",
    "CONTINUE_RESPONSE_TRAILERS",
    "DESTINATION_HEADER",
    "END_OF_REQUEST_BODY",
    "END_OF_RESPONSE_BODY",
    "FULL_DUPLEX",
    "MAX_STREAMED_CHUNK",
    "NONE",
    "OBSERVE_KEY",
    "SUBSET_HINT_KEY",
    "SUBSET_HINT_NAMESPACE",
    "TOKEN_LENGTH",
    "headers_of",
    "immediate",
    "mode_name",
    "observed_token",
    "response_headers_answer",
    "routing_answer",
    "streamed_body",
    "subset_hint",
    "token_metadata",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SCORES_KEY = "x-gateway-destination-endpoint-scores"  # (--emit-endpoint-scores: ip:port -> score, a struct)
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
OBSERVE_KEY = "request"  # under OBSERVE_NAMESPACE: the picker's token for a request whose response Envoy observes
# The upstream picker streams bodies back in pieces of at most this size; Envoy's default buffer
# limits (64 KiB) sit just above it.
MAX_STREAMED_CHUNK = 62_000

_Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
BUFFERED = _Mode.BUFFERED
NONE = _Mode.NONE
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD

# Constant answers, built once.
CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_JSON_CONTENT_TYPE = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_OVERWRITE
)


def streamed_body(phase: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """A ``phase`` (request_body or response_body) answer carrying ``chunk`` as a streamed body mutation."""
    answer = pb.ProcessingResponse()
    # Setting fields through the parent is ~4x cheaper than nesting constructors (upb copies each level).
    streamed = getattr(answer, phase).response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream
    return answer


END_OF_REQUEST_BODY = streamed_body("request_body", b"", True)
END_OF_RESPONSE_BODY = streamed_body("response_body", b"", True)
# (phase, destination) -> the routing answer; bounded, since fallback lists make combinations.
_ANSWERS: dict[tuple[str, str], pb.ProcessingResponse] = {}
_MAX_CACHED_ANSWERS = 4096


def response_headers_answer(added: Mapping[str, str]) -> pb.ProcessingResponse:
    """Continue the response with the headers plugins asked to set on it."""
    mutation = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
            )
            for key, value in added.items()
        ]
    )
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(response=pb.CommonResponse(header_mutation=mutation))
    )


def _header_option(item: tuple[str, str]) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=item[0], raw_value=item[1].encode()), append_action=_OVERWRITE
    )


def immediate(error: EppError) -> pb.ProcessingResponse:
    status, body = http_answer(error)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_JSON_CONTENT_TYPE, *map(_header_option, error.headers.items())]),
            body=body,
            details=f"epp_{error.reason.value}",
        )
    )


def routing_answer(
    routed: RoutedRequest, client_headers: Iterable[str], phase: str, propagate: Mapping[str, str] | None = None
) -> pb.ProcessingResponse:
    """The answer (to ``phase``: request_headers, or request_body in BUFFERED mode) that sends the
    request to ``routed``'s pick: the destination header, the same value as ``envoy.lb`` metadata,
    clear_route_cache, and the removal of forged control headers. ``propagate``: headers to set on
    the request too (a traced request's ``traceparent``); such an answer is never cached, nor one
    that carries the pick's scores (``--emit-endpoint-scores``: under :data:`SCORES_KEY` beside the
    destination, every endpoint the primary profile scored, as upstream emits them).

    Without forged headers the answer depends only on the destination, and a pool has few of those:
    such answers are built once and reused.
    """
    forged = [name for name in client_headers if name.startswith(DESTINATION_HEADER) and name != DESTINATION_HEADER]
    destination = routed.destination
    scores = routed.scores
    cacheable = not forged and not propagate and not scores
    if cacheable:
        cached = _ANSWERS.get((phase, destination))
        if cached is not None:
            return cached
    mutation = pb.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
                append_action=_OVERWRITE,
            ),
            *map(_header_option, propagate.items() if propagate else ()),
        ],
        # Forged control headers (…-subset, …-served, …-fallback): only the picker speaks them.
        remove_headers=forged,
    )
    answer = pb.ProcessingResponse()
    getattr(answer, phase).response.CopyFrom(pb.CommonResponse(header_mutation=mutation, clear_route_cache=True))
    lb = answer.dynamic_metadata.fields[DESTINATION_NAMESPACE].struct_value.fields
    lb[DESTINATION_HEADER].string_value = destination
    if scores:
        lb[SCORES_KEY].struct_value.update(scores)
    if cacheable:
        if len(_ANSWERS) >= _MAX_CACHED_ANSWERS:
            _ANSWERS.clear()
        _ANSWERS[(phase, destination)] = answer
    return answer


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
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


def headers_of(message: pb.HttpHeaders) -> dict[str, str]:
    # Envoy fills raw_value (bytes); older versions and hand-written clients use value.
    return {h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in message.headers.headers}


def mode_name(mode: int) -> str:
    """The name of a body send mode (for messages)."""
    return str(_Mode.BodySendMode.Name(mode))


TOKEN_LENGTH = 24  # (token_metadata's bytes are built for this length: their length prefixes are fixed)


def _token_parts() -> tuple[bytes, bytes]:
    answer = pb.ProcessingResponse()
    placeholder = "\x00" * TOKEN_LENGTH
    answer.dynamic_metadata.fields[OBSERVE_NAMESPACE].struct_value.fields[OBSERVE_KEY].string_value = placeholder
    before, after = answer.SerializeToString().split(placeholder.encode())
    return before, after


_TOKEN_BEFORE, _TOKEN_AFTER = _token_parts()


def token_metadata(token: str) -> bytes:
    """Bytes to append to a serialized routing answer: its dynamic metadata gets ``token`` under
    :data:`OBSERVE_NAMESPACE` (protobuf merges a message field given twice, and a map's entries), so
    that the filter observing the response (``epp envoy-config --observe-responses``) can name the
    request. ``token`` is :data:`TOKEN_LENGTH` ASCII characters. A gateway that does not list the
    namespace among ext_proc's receiving namespaces drops it."""
    return _TOKEN_BEFORE + token.encode() + _TOKEN_AFTER


def observed_token(request: pb.ProcessingRequest) -> str | None:
    """The picker's token in an observed stream's metadata (see :func:`token_metadata`), if any."""
    namespaces = request.metadata_context.filter_metadata
    if OBSERVE_NAMESPACE not in namespaces:
        return None
    value = namespaces[OBSERVE_NAMESPACE].fields.get(OBSERVE_KEY)
    return value.string_value if value is not None and value.WhichOneof("kind") == "string_value" else None
