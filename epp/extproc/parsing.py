"""What the picker knows about one inference request: parsed once, read by every plugin.

Design
------
The body of an OpenAI-style request is decoded exactly once, by msgspec, straight into small typed
structs that declare only the fields routing needs (``model``, the prompt-bearing field, ``stream``,
``cache_salt``...). Unknown fields are skipped by the C decoder without building Python objects, so
a 400 KB prompt costs about a hundred microseconds and no per-character Python work. msgspec also
rejects invalid UTF-8, malformed JSON and a wrongly typed ``model`` with a message that names the field
(``Expected `str`, got `int` - at `$.model```), which becomes the client's 400 message.

Never stricter than the engine
------------------------------
vLLM validates bodies with pydantic in lax mode, so it serves ``"max_tokens": "3"``, ``3.0``,
``"stream": "false"`` and a body with no ``model`` (its default model). The picker refuses only what
vLLM refuses too and what routing cannot do without: a body that is not UTF-8, not JSON or not an
object, and a ``model`` that is not a string (or null). Everything else it routes:

* the typed structs take the forms nearly every client sends; a body they refuse anywhere but at
  ``model`` (``"max_tokens": "3"``, token ids written ``"1"`` or ``1.0``, odd content parts) is decoded
  a second time, loosely (``_LooseBody``): the routing-only scalars (``stream``, ``max_tokens`` and its
  newer names, ``cache_salt``) as raw JSON read with pydantic's lax coercions (:mod:`epp.extproc.lax`),
  the prompt-bearing field as plain JSON rendered as the typed path renders it. A scalar pydantic
  would refuse just does not help routing (the default is used) and vLLM answers it. Only such rare
  bodies pay for the second decode. Mixed prompt lists that vLLM refuses too (``["a", 1]``) keep
  their 400, as does a chat message without ``role``;
* a missing, null or empty ``model`` is routed with model ``""`` (vLLM serves its default model);
* a path the picker does not know (``/v1/audio/transcriptions`` is multipart, ``/tokenize``...) is
  never refused: a JSON object's string ``model`` is read if there is one.

Which struct to decode into is chosen by the request path (``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``). Body-less requests
(``GET /v1/models``) are routed too, with no model.

``prompt`` is the text later hashed for prefix-cache affinity. Chat messages and Responses-API
items are rendered deterministically (role markers + content parts) so the same conversation
always yields the same text, and a conversation that grows keeps its earlier text as a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import msgspec

from epp.errors import EppError, Reason
from epp.extproc.lax import lax_bool, lax_int, lax_salt, loose_prompt_text, loose_turn, newer, token_text
from epp.framework import Api, InferenceRequest

__all__ = ["api_for_path", "parse_request"]


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
    model: str | None = None
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


# A routing-only scalar absent from the body. Raw keeps the value's JSON text: no Python object is
# built for it, and a value of a shape routing cannot use can never fail the decode.
_ABSENT = msgspec.Raw(b"")


class _LooseBody(msgspec.Struct):
    """The second, loose decode of a body the typed structs refused (a value of a form pydantic's lax
    mode takes, or of none): the routing scalars as raw JSON, every prompt-bearing field any API has as
    plain JSON values. Only such rare bodies pay for it."""

    model: str | None = None
    stream: msgspec.Raw = _ABSENT
    cache_salt: msgspec.Raw = _ABSENT
    max_tokens: msgspec.Raw = _ABSENT
    prompt: object = None
    messages: object = None
    input: object = None
    instructions: object = None
    max_completion_tokens: msgspec.Raw = _ABSENT
    max_output_tokens: msgspec.Raw = _ABSENT


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
}
_LOOSE_DECODER = msgspec.json.Decoder(_LooseBody)


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
    request_id, method = headers.get("x-request-id", ""), headers.get(":method", "")
    if not body:
        if api is not Api.OTHER:
            raise EppError(Reason.BAD_REQUEST, f"{path} needs a JSON body")
        return InferenceRequest(request_id, method, path, headers, api)
    if api is Api.OTHER:
        return _other_request(request_id, method, path, headers, body, base_models)

    refusal = ""  # the typed decode's 400 message, kept for a loosely read field vLLM refuses too
    try:
        parsed: _Common | _LooseBody = _DECODERS[api].decode(body)
    except msgspec.ValidationError as exc:
        parsed, refusal = _loose_decode(path, body, exc), f"invalid request body for {path}: {exc}"
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise EppError(Reason.BAD_REQUEST, "request body is not valid UTF-8") from exc
        raise EppError(Reason.BAD_REQUEST, f"request body is not valid JSON: {text}") from exc

    if isinstance(parsed, _LooseBody):
        prompt, max_tokens = _loose_prompt(api, parsed, refusal)
        stream, cache_salt = lax_bool(parsed.stream), lax_salt(parsed.cache_salt)
    else:
        prompt, max_tokens = _typed_prompt(parsed)
        salt = parsed.cache_salt  # vLLM refuses "" and over 1024 characters: then it is no salt
        stream, cache_salt = bool(parsed.stream), salt if salt and len(salt) <= 1024 else None
    model = parsed.model or ""
    return InferenceRequest(
        request_id,
        method,
        path,
        headers,
        api,
        model=model,
        adapter=_adapter(model, base_models),
        prompt=prompt,
        stream=stream,
        cache_salt=cache_salt,
        max_tokens=max_tokens,
        body_size=len(body),
    )


def _typed_prompt(parsed: _Common) -> tuple[str, int | None]:
    """The prompt and max tokens of a body the typed structs decoded (the newer field wins)."""
    max_tokens = parsed.max_tokens
    if isinstance(parsed, _Completion):
        return _prompt_text(parsed.prompt, "prompt"), max_tokens
    if isinstance(parsed, _ChatCompletion):
        newer_max = parsed.max_completion_tokens
        return _render_messages(parsed.messages), max_tokens if newer_max is None else newer_max
    if isinstance(parsed, _Embedding):
        return _prompt_text(parsed.input, "input"), max_tokens
    if isinstance(parsed, _Response):
        newer_max = parsed.max_output_tokens
        return _render_response_input(parsed), max_tokens if newer_max is None else newer_max
    return "", max_tokens


def _adapter(model: str, base_models: frozenset[str]) -> str | None:
    return None if not model or model in base_models else model


def _other_request(
    request_id: str, method: str, path: str, headers: Mapping[str, str], body: bytes, base_models: frozenset[str]
) -> InferenceRequest:
    """A body for a path the picker does not know: whatever it is (multipart audio, JSON of any shape),
    the engine judges it; a JSON object's string ``model`` is read when there is one."""
    try:
        parsed: _LooseBody = _LOOSE_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError):
        parsed = _LooseBody()
    model = parsed.model or ""
    return InferenceRequest(
        request_id,
        method,
        path,
        headers,
        Api.OTHER,
        model=model,
        adapter=_adapter(model, base_models),
        stream=lax_bool(parsed.stream),
        cache_salt=lax_salt(parsed.cache_salt),
        max_tokens=lax_int(parsed.max_tokens),
        body_size=len(body),
    )


# --- the prompt-bearing fields -------------------------------------------------------------------


def _loose_decode(path: str, body: bytes, exc: msgspec.ValidationError) -> _LooseBody:
    """The second decode of a body the typed struct refused; what vLLM refuses too keeps its 400:
    a body that is not an object (no ``$.`` path in msgspec's message), a ``model`` that is no string,
    a chat message without ``role`` (every message type of vLLM's requires one)."""
    text = str(exc)
    if "`$." not in text or "`$.model`" in text or "field `role`" in text:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: {text}") from exc
    try:
        loose: _LooseBody = _LOOSE_DECODER.decode(body)
    except msgspec.ValidationError as again:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: {again}") from again
    return loose


def _loose_prompt(api: Api, loose: _LooseBody, refusal: str) -> tuple[str, int | None]:
    """The prompt and max tokens of a loosely decoded body (rendered as the typed path renders them)."""
    max_tokens = lax_int(loose.max_tokens)
    if api is Api.COMPLETIONS:
        return loose_prompt_text(loose.prompt, "prompt", refusal), max_tokens
    if api is Api.EMBEDDINGS:
        return loose_prompt_text(loose.input, "input", refusal), max_tokens
    if api is Api.CHAT_COMPLETIONS:
        if not isinstance(loose.messages, list | None):
            raise EppError(Reason.BAD_REQUEST, refusal)
        messages = [loose_turn(item, refusal) for item in loose.messages or []]
        return "".join(messages), newer(loose.max_completion_tokens, max_tokens)
    max_tokens = newer(loose.max_output_tokens, max_tokens)
    head = f"<|system|>\n{loose.instructions}\n" if isinstance(loose.instructions, str) and loose.instructions else ""
    if isinstance(loose.input, str):
        return f"{head}<|user|>\n{loose.input}\n", max_tokens
    items = loose.input if isinstance(loose.input, list) else []
    turns = [loose_turn(item, None) for item in items if isinstance(item, dict)]
    return head + "".join(turns), max_tokens


def _prompt_text(value: str | list[str | int | list[int]], name: str) -> str:
    """The text of a completions ``prompt`` / embeddings ``input``: a string, a list of strings,
    a list of token ids or a list of token-id lists (OpenAI's four forms); a mixed list is read as
    vLLM reads it (``["1", 2]`` is token ids) or refused as it refuses it."""
    if isinstance(value, str):
        return value
    if not value:
        return ""
    kinds = {type(item) for item in value}
    if len(kinds) != 1:
        return loose_prompt_text(value, name, "")
    kind = kinds.pop()
    # One kind of item throughout (checked above): the casts name which.
    if kind is str:
        return "\n".join(cast(list[str], value))
    if kind is int:
        return token_text(cast(list[int], value))
    return "\n".join(token_text(ids) for ids in cast(list[list[int]], value))


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
