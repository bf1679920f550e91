"""What the picker knows about one inference request: parsed once, read by every plugin.

Design
------
The body of an OpenAI-style request is decoded exactly once, by msgspec, straight into small typed
structs that declare only the fields routing needs (``model``, the prompt-bearing field, ``stream``,
``cache_salt``...). Unknown fields are skipped by the C decoder without building Python objects, so
a 400 KB prompt costs about a hundred microseconds and no per-character Python work. msgspec also
rejects invalid UTF-8, malformed JSON and wrongly typed fields with a message that names the field
(``Expected `str`, got `int` - at `$.model```), which becomes the client's 400 message.

Which struct to decode into is chosen by the request path (``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``); any other path with a body only
needs a string ``model``. Body-less requests (``GET /v1/models``) are routed too, with no model.

``prompt`` is the text later hashed for prefix-cache affinity. Chat messages and Responses-API
items are rendered deterministically (role markers + content parts) so the same conversation
always yields the same text, and a conversation that grows keeps its earlier text as a prefix.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from epp.errors import EppError, Reason

__all__ = ["Api", "InferenceRequest", "parse_request"]


class Api(enum.Enum):
    """The OpenAI-compatible API a request addresses (from its path)."""

    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat_completions"
    EMBEDDINGS = "embeddings"
    RESPONSES = "responses"
    OTHER = "other"


@dataclass(slots=True)
class InferenceRequest:
    """One request as the scheduler sees it. Built by :func:`parse_request`; treat as read-only.

    Attributes:
        request_id: the ``x-request-id`` header Envoy sets (or "" when absent).
        method, path: from the ``:method`` and ``:path`` pseudo-headers.
        headers: request headers, lower-case names (pseudo-headers included).
        api: which API the path addresses.
        model: the requested model ("" for body-less requests).
        adapter: the LoRA adapter the request names: the requested model unless it is one of the
            pool's known base models; None when there is no model.
        prompt: the text used for prefix-cache affinity ("" when the body has none).
        stream: whether the client asked for a streamed (SSE) answer.
        cache_salt: vLLM's ``cache_salt``; prefix hashes must be salted with it.
        max_tokens: the requested output budget, when given.
        body_size: bytes of request body received.
        objective: the InferenceObjective the request names (``x-llm-d-inference-objective``,
            or ``x-gateway-inference-objective``); "" when none. Set by the director.
        priority: the objective's priority (0 by default; < 0 is sheddable). Set by the director.
        state: per-request data that plugins share during the request's life, keyed by the data
            names plugins declare in ``produces``/``consumes`` (see :mod:`epp.scheduling.runner`).
    """

    request_id: str
    method: str
    path: str
    headers: Mapping[str, str]
    api: Api = Api.OTHER
    model: str = ""
    adapter: str | None = None
    prompt: str = ""
    stream: bool = False
    cache_salt: str | None = None
    max_tokens: int | None = None
    body_size: int = 0
    objective: str = ""
    priority: int = 0
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens, estimated at 4 characters per token (no tokenizer here)."""
        return (len(self.prompt) + 3) // 4


# --- the typed views of each API's body: only what routing reads --------------------------------


class _Part(msgspec.Struct):
    """A content part; non-text parts (images, audio) carry no ``text`` and add nothing to the prompt."""

    type: str = "text"
    text: str | None = None


_Content = str | list[_Part] | None


class _ChatMessage(msgspec.Struct):
    role: str
    content: _Content = None


class _Common(msgspec.Struct):
    model: str
    stream: bool | None = False
    cache_salt: str | None = None
    max_tokens: int | None = None


class _Completion(_Common):
    prompt: str | list[str | int | list[int]] = ""


class _ChatCompletion(_Common):
    messages: list[_ChatMessage] = []
    max_completion_tokens: int | None = None


class _Embedding(_Common):
    input: str | list[str | int | list[int]] = ""


class _ResponseItem(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    content: _Content = None


class _Response(_Common):
    input: str | list[_ResponseItem] = ""
    instructions: str | None = None
    max_output_tokens: int | None = None


_API_BY_PATH: dict[str, Api] = {
    "/v1/completions": Api.COMPLETIONS,
    "/v1/chat/completions": Api.CHAT_COMPLETIONS,
    "/v1/embeddings": Api.EMBEDDINGS,
    "/v1/responses": Api.RESPONSES,
}

_DECODERS: dict[Api, msgspec.json.Decoder] = {
    Api.COMPLETIONS: msgspec.json.Decoder(_Completion),
    Api.CHAT_COMPLETIONS: msgspec.json.Decoder(_ChatCompletion),
    Api.EMBEDDINGS: msgspec.json.Decoder(_Embedding),
    Api.RESPONSES: msgspec.json.Decoder(_Response),
    Api.OTHER: msgspec.json.Decoder(_Common),
}


def api_for_path(path: str) -> Api:
    """The API addressed by ``path`` (query string ignored)."""
    return _API_BY_PATH.get(path.partition("?")[0].rstrip("/"), Api.OTHER)


def parse_request(
    headers: Mapping[str, str],
    body: bytes,
    *,
    base_models: frozenset[str] = frozenset(),
) -> InferenceRequest:
    """Parse one request. Raises :class:`EppError` (BAD_REQUEST) saying what is wrong with the body."""
    path = headers.get(":path", "")
    api = api_for_path(path)
    request = InferenceRequest(
        request_id=headers.get("x-request-id", ""),
        method=headers.get(":method", ""),
        path=path,
        headers=headers,
        api=api,
        body_size=len(body),
    )
    if not body:
        if api is not Api.OTHER:
            raise EppError(Reason.BAD_REQUEST, f"{path} needs a JSON body with a `model` field")
        return request

    try:
        parsed = _DECODERS[api].decode(body)
    except msgspec.ValidationError as exc:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: {exc}") from exc
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise EppError(Reason.BAD_REQUEST, "request body is not valid UTF-8") from exc
        raise EppError(Reason.BAD_REQUEST, f"request body is not valid JSON: {text}") from exc

    if not parsed.model:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: `model` must not be empty")
    request.model = parsed.model
    request.adapter = None if parsed.model in base_models else parsed.model
    request.stream = bool(parsed.stream)
    request.cache_salt = parsed.cache_salt
    request.max_tokens = parsed.max_tokens
    if isinstance(parsed, _Completion):
        request.prompt = _prompt_text(parsed.prompt, "prompt")
    elif isinstance(parsed, _ChatCompletion):
        request.prompt = _render_messages(parsed.messages)
        if parsed.max_completion_tokens is not None:
            request.max_tokens = parsed.max_completion_tokens
    elif isinstance(parsed, _Embedding):
        request.prompt = _prompt_text(parsed.input, "input")
    elif isinstance(parsed, _Response):
        request.prompt = _render_response_input(parsed)
        if parsed.max_output_tokens is not None:
            request.max_tokens = parsed.max_output_tokens
    return request


def _prompt_text(value: str | list[str | int | list[int]], name: str) -> str:
    """The text of a completions ``prompt`` / embeddings ``input``: a string, a list of strings,
    a list of token ids or a list of token-id lists (OpenAI's four forms, never mixed)."""
    if isinstance(value, str):
        return value
    if not value:
        return ""
    kinds = {type(item) for item in value}
    if len(kinds) != 1:
        raise EppError(
            Reason.BAD_REQUEST,
            f"invalid request body: `{name}` must be a string, a list of strings, a list of token ids "
            "or a list of token-id lists, not a mix",
        )
    kind = kinds.pop()
    if kind is str:
        return "\n".join(value)  # type: ignore[arg-type]
    if kind is int:
        return _token_text(value)  # type: ignore[arg-type]
    return "\n".join(_token_text(ids) for ids in value)  # type: ignore[union-attr]


def _token_text(ids: list[int]) -> str:
    # Token-id prompts have no text; their ids, written out, still share prefixes exactly when the
    # prompts do, which is all prefix affinity needs.
    return " ".join(map(str, ids))


def _content_text(content: _Content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content if part.text is not None)


def _render_messages(messages: list[_ChatMessage]) -> str:
    return "".join([f"<|{m.role}|>\n{_content_text(m.content)}\n" for m in messages])


def _render_response_input(parsed: _Response) -> str:
    head = f"<|system|>\n{parsed.instructions}\n" if parsed.instructions else ""
    if isinstance(parsed.input, str):
        return f"{head}<|user|>\n{parsed.input}\n"
    return head + "".join(
        [f"<|{item.role or item.type or 'user'}|>\n{_content_text(item.content)}\n" for item in parsed.input]
    )
