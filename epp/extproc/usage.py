"""The token usage a model server reports at the end of a response, read without touching the rest.

OpenAI-style servers (vLLM, SGLang) report ``usage`` (``prompt_tokens``, ``completion_tokens``):

* in a JSON response, as a top-level field of the body;
* in an SSE stream, in a final ``data:`` event before ``data: [DONE]``, when the client asked with
  ``stream_options: {"include_usage": true}`` (vLLM also with ``continuous_usage_stats``, in every
  event: the last one is the total).

The response path keeps only the last few chunks it forwards (:data:`TAIL_CHUNKS`, by reference: a
list append, no copy, no parsing per chunk), for a stream and a JSON body alike: the usage comes at
the end of both (vLLM writes it as the last fields of a JSON body, and as the last event before
``[DONE]``), so memory per response stays a few chunks whatever the body's size. When the response
ends, :func:`usage_of` looks for it in what was kept: the last ``data:`` event carrying ``"usage"``
for a stream, the last ``"usage": {...}`` object of a JSON body (found with ``bytes.rfind``, then
decoded alone by msgspec, up to the first closing brace that ends it). What is not there, or not well
formed, is simply no usage: this never fails or alters a response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

__all__ = ["TAIL_CHUNKS", "Usage", "usage_of"]

TAIL_CHUNKS = 4  # the usage comes last (a stream: last but one, before [DONE]); a few more for split writes


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Body(msgspec.Struct):
    usage: _Usage | None = None


_decode_usage = msgspec.json.Decoder(_Body).decode  # an SSE event: a whole JSON object
_decode_object = msgspec.json.Decoder(_Usage).decode  # the usage object alone
_MAX_TRIES = 64


def usage_of(chunks: Sequence[bytes], *, stream: bool) -> Usage | None:
    """The usage in a response's kept ``chunks`` (see the module docstring), or None."""
    if not chunks:
        return None
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        usage = _last_event_usage(data) if stream else _last_usage_object(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if usage is None or usage.prompt_tokens < 0 or usage.completion_tokens < 0:
        return None
    return Usage(usage.prompt_tokens, usage.completion_tokens)


def _last_usage_object(data: bytes) -> _Usage | None:
    """The last ``"usage": {...}`` object in a JSON body's tail, decoded alone.

    The object ends at one of the closing braces after its opening one: the first at which msgspec
    decodes a whole object is its own (a JSON object's text ends where parsing it ends, so no shorter
    piece ending at a brace is one), and a piece that ends early fails at its end, in C. A nested
    object (``prompt_tokens_details``) costs one try more; more than :data:`_MAX_TRIES` braces is no
    usage, so that a hostile tail cannot make this quadratic.
    """
    at = data.rfind(b'"usage"')
    if at < 0:
        return None
    start = data.find(b"{", at)
    if start < 0 or data[at + 7 : start].strip() != b":":
        return None  # "usage": null, or the key inside a string
    view = memoryview(data)
    end = start
    for _ in range(_MAX_TRIES):
        end = data.find(b"}", end + 1)
        if end < 0:
            return None
        try:
            return _decode_object(view[start : end + 1])
        except msgspec.DecodeError:
            continue  # not whole yet (a ValidationError is a whole object of the wrong shape: raised)
    return None


def _last_event_usage(data: bytes) -> _Usage | None:
    end = len(data)
    while True:
        at = data.rfind(b'"usage"', 0, end)
        if at < 0:
            return None
        start = data.rfind(b"data:", 0, at)
        if start < 0:
            return None
        stop = data.find(b"\n", at)
        event = data[start + 5 : stop if stop >= 0 else len(data)].strip()
        try:
            usage = _decode_usage(event).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            usage = None  # a partial event (the kept tail began inside it), or "usage": null
        if usage is not None:
            return usage
        end = start
