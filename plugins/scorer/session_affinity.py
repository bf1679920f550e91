"""``session-affinity-scorer`` (llm-d): keep a client's session on the endpoint that served it.

Upstream semantics (llm-d, the ``encoded_endpoint_header`` algorithm, its default): stateless.
Every response carries the header ``x-session-token`` naming the endpoint that served it; a client
that sends the header back on its next request has that endpoint score 1.0 and every other 0.0.
The affinity is soft: other scorers can outweigh it (a filter that pins sessions is a different
plugin upstream).

The token is the standard base64 (with padding) of the endpoint's name, as upstream's is of the
pod's ``namespace/name``: when endpoints are named that way the tokens are interchangeable with
upstream's. A missing or undecodable token, or one naming an endpoint not among the candidates,
gives every candidate 0.0. The framework sets the header returned by ``response_received`` on the
response the client receives.

An endpoint whose metrics are stale counts as fully loaded: even when the token names it, it scores
0.0 (it may be gone; the session moves, and the next response carries the new endpoint's token).

Parameters (upstream names):
    headerName (string, default "x-session-token"): the request and response header carrying the
        token (matched case-insensitively).
    algorithm (string, default "encoded_endpoint_header"): only ``encoded_endpoint_header`` is
        implemented; ``session_id_header`` (server-side session bindings) and its parameters, and
        ``profileName`` (disaggregated serving), are refused with a message saying so.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters, str_parameter

DEFAULT_HEADER = "x-session-token"  # llm-d's sessionTokenHeader
ALGORITHM = "encoded_endpoint_header"

# Upstream parameters this implementation refuses by name rather than as unknown.
_NOT_IMPLEMENTED = {
    "profileName": "per-profile tokens (disaggregated serving) are not implemented",
    "evictionTtlSeconds": "the session_id_header algorithm is not implemented",
    "evictionSweepSeconds": "the session_id_header algorithm is not implemented",
    "missThreshold": "the session_id_header algorithm is not implemented",
}
# An HTTP header name: an RFC 9110 token.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def encode_token(endpoint_name: str) -> str:
    """The session token naming ``endpoint_name``."""
    return base64.b64encode(endpoint_name.encode()).decode("ascii")


def decode_token(token: str) -> str | None:
    """The endpoint name a token carries; None when it is not valid base64 of UTF-8 text."""
    try:
        return base64.b64decode(token, validate=True).decode()
    except (binascii.Error, ValueError):  # UnicodeDecodeError is a ValueError
        return None


class SessionAffinityScorer:
    def __init__(self, name: str = "session-affinity-scorer", *, header_name: str = DEFAULT_HEADER) -> None:
        if not _HEADER_NAME.fullmatch(header_name):
            raise ValueError(f"{name}: headerName {header_name!r} is not a valid HTTP header name")
        self.name = name
        self.header_name = header_name.lower()  # request headers arrive lower-cased

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> SessionAffinityScorer:
        for key, reason in _NOT_IMPLEMENTED.items():
            if key in parameters:
                raise ValueError(f"{name}: upstream parameter {key} is not supported: {reason}")
        check_parameters(name, parameters, ("headerName", "algorithm"))
        algorithm = str_parameter(name, parameters, "algorithm", ALGORITHM)
        if algorithm != ALGORITHM:
            detail = " (not implemented)" if algorithm == "session_id_header" else ""
            raise ValueError(f"{name}: algorithm {algorithm!r} is not supported{detail}; supported: {ALGORITHM!r}")
        return cls(name, header_name=str_parameter(name, parameters, "headerName", DEFAULT_HEADER))

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        token = request.headers.get(self.header_name)
        target = decode_token(token) if token else None
        return [1.0 if e.name == target and not e.metrics.stale else 0.0 for e in candidates]

    def response_received(
        self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]
    ) -> Mapping[str, str] | None:
        return {self.header_name: encode_token(endpoint.name)}
