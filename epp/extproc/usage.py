"""The token usage a model server reports at the end of a response, read without touching the rest.

OpenAI-style servers (vLLM, SGLang) report ``usage`` (``prompt_tokens``, ``completion_tokens``):

* in a JSON response, as a top-level field of the body;
* in an SSE stream, in a final ``data:`` event before ``data: [DONE]``, when the client asked with
  ``stream_options: {"include_usage": true}`` (vLLM also with ``continuous_usage_stats``, in every
  event: the last one is the total).

The response path keeps the chunks it forwards only by reference (a list append; no copy, no
parsing per chunk), bounded: for a stream the last few chunks, for a JSON body up to
:data:`MAX_JSON_BODY` bytes. When the response ends, :func:`usage_of` looks for the usage in what was
kept: the last ``data:`` event carrying ``"usage"`` for a stream (searched from the end with
``bytes.rfind``), the body's top-level ``usage`` for JSON (msgspec decodes that field only). What is
not there, or not well formed, is simply no usage: this never fails or alters a response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

__all__ = ["MAX_JSON_BODY", "STREAM_TAIL_CHUNKS", "Usage", "usage_of"]

MAX_JSON_BODY = 4 * 1024 * 1024  # a non-streamed answer larger than this is not searched for usage
STREAM_TAIL_CHUNKS = 4  # the usage event comes last but one (before [DONE]); a few more for split writes


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Body(msgspec.Struct):
    usage: _Usage | None = None


_decode_body = msgspec.json.Decoder(_Body).decode
_decode_usage = msgspec.json.Decoder(_Body).decode


def usage_of(chunks: Sequence[bytes], *, stream: bool) -> Usage | None:
    """The usage in a response's kept ``chunks`` (see the module docstring), or None."""
    if not chunks:
        return None
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    try:
        if not stream:
            body = _decode_body(data)
            usage = body.usage
        else:
            usage = _last_event_usage(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    if usage is None or usage.prompt_tokens < 0 or usage.completion_tokens < 0:
        return None
    return Usage(usage.prompt_tokens, usage.completion_tokens)


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
