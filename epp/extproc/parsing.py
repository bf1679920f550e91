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

* the routing-only scalars (``stream``, ``max_tokens`` and its newer names, ``cache_salt``) are kept
  as raw JSON and read with pydantic's lax coercions (:func:`_lax_bool`, :func:`_lax_int`); a value
  pydantic would refuse just does not help routing (the default is used) and vLLM answers it;
* a missing, null or empty ``model`` is routed with model ``""`` (vLLM serves its default model);
* a prompt-bearing field the typed structs cannot describe (token ids written as ``"1"`` or ``1.0``,
  odd content parts) is decoded a second time, loosely, and its text rendered best-effort; the
  second decode costs Python objects, but only for such rare bodies. Mixed prompt lists that vLLM
  refuses too (``["a", 1]``) keep their 400, as does a chat message without ``role``;
* a path the picker does not know (``/v1/audio/transcriptions`` is multipart, ``/tokenize``...) is
  never refused: a JSON object's string ``model`` is read if there is one.

Which struct to decode into is chosen by the request path (``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``); any other path with a body only
needs a string ``model``. Body-less requests (``GET /v1/models``) are routed too, with no model.

``prompt`` is the text later hashed for prefix-cache affinity. Chat messages and Responses-API
items are rendered deterministically (role markers + content parts) so the same conversation
always yields the same text, and a conversation that grows keeps its earlier text as a prefix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import cast

import msgspec

from epp.errors import EppError, Reason
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


# A routing-only scalar absent from the body. Raw keeps the value's JSON text: no Python object is
# built for it, and a value of a shape routing cannot use can never fail the decode.
_ABSENT = msgspec.Raw(b"")
# A routing scalar longer than this is no number, boolean or salt vLLM accepts (a salt is at most
# 1024 characters): it is not decoded at all.
_MAX_SCALAR_BYTES = 1100


class _Common(msgspec.Struct):
    model: str | None = None
    stream: msgspec.Raw = _ABSENT
    cache_salt: msgspec.Raw = _ABSENT
    max_tokens: msgspec.Raw = _ABSENT


class _Completion(_Common):
    prompt: str | list[str | int | list[int]] = ""


class _ChatCompletion(_Common):
    messages: list[_ChatMessage] = []
    max_completion_tokens: msgspec.Raw = _ABSENT


class _Embedding(_Common):
    input: str | list[str | int | list[int]] = ""


class _ResponseItem(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    content: _Content = None


class _Response(_Common):
    input: str | list[_ResponseItem] = ""
    instructions: str | None = None
    max_output_tokens: msgspec.Raw = _ABSENT


class _LooseBody(_Common):
    """The second, loose decode of a body whose prompt-bearing field the typed structs refused:
    every prompt-bearing field any API has, as plain JSON values."""

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
    Api.OTHER: msgspec.json.Decoder(_Common),
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
        parsed: _Common = _DECODERS[api].decode(body)
    except msgspec.ValidationError as exc:
        parsed, refusal = _loose_decode(path, body, exc), f"invalid request body for {path}: {exc}"
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise EppError(Reason.BAD_REQUEST, "request body is not valid UTF-8") from exc
        raise EppError(Reason.BAD_REQUEST, f"request body is not valid JSON: {text}") from exc

    max_tokens = _lax_int(parsed.max_tokens)
    prompt = ""
    if isinstance(parsed, _LooseBody):
        prompt, newer_max = _loose_prompt(api, parsed, refusal)
        max_tokens = newer_max if newer_max is not None else max_tokens
    elif isinstance(parsed, _Completion):
        prompt = _prompt_text(parsed.prompt, "prompt")
    elif isinstance(parsed, _ChatCompletion):
        prompt = _render_messages(parsed.messages)
        max_tokens = _newer(parsed.max_completion_tokens, max_tokens)
    elif isinstance(parsed, _Embedding):
        prompt = _prompt_text(parsed.input, "input")
    elif isinstance(parsed, _Response):
        prompt = _render_response_input(parsed)
        max_tokens = _newer(parsed.max_output_tokens, max_tokens)
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
        stream=_lax_bool(parsed.stream),
        cache_salt=_lax_salt(parsed.cache_salt),
        max_tokens=max_tokens,
        body_size=len(body),
    )


def _adapter(model: str, base_models: frozenset[str]) -> str | None:
    return None if not model or model in base_models else model


def _other_request(
    request_id: str, method: str, path: str, headers: Mapping[str, str], body: bytes, base_models: frozenset[str]
) -> InferenceRequest:
    """A body for a path the picker does not know: whatever it is (multipart audio, JSON of any shape),
    the engine judges it; a JSON object's string ``model`` is read when there is one."""
    try:
        parsed: _Common = _DECODERS[Api.OTHER].decode(body)
    except (msgspec.DecodeError, RecursionError):
        parsed = _Common()
    model = parsed.model or ""
    return InferenceRequest(
        request_id,
        method,
        path,
        headers,
        Api.OTHER,
        model=model,
        adapter=_adapter(model, base_models),
        stream=_lax_bool(parsed.stream),
        cache_salt=_lax_salt(parsed.cache_salt),
        max_tokens=_lax_int(parsed.max_tokens),
        body_size=len(body),
    )


# --- pydantic's lax coercions, for the routing-only scalars --------------------------------------
# vLLM's request models (vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py)
# declare ``stream: bool | None``, ``max_tokens: int | None``, ``cache_salt: str | None`` (1 to 1024
# characters) and validate them in pydantic's lax mode; these functions accept what it accepts and
# give None (the default) for what it refuses, since such a value only means no routing hint.

_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0*)?")
_INT64_LIMIT = 2**63


def _scalar(raw: msgspec.Raw) -> object:
    if not raw or len(raw) > _MAX_SCALAR_BYTES:
        return None
    return msgspec.json.decode(raw)  # already checked to be JSON by the body's decode


def _lax_bool(raw: msgspec.Raw) -> bool:
    value = _scalar(raw)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1  # pydantic takes 0, 1, 0.0 and 1.0; anything else is not a stream flag
    if isinstance(value, str):
        return value.lower() in _TRUE_WORDS
    return False


def _lax_int_value(value: object) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < _INT64_LIMIT else None
    if isinstance(value, str):
        text = value.strip()
        return int(text.partition(".")[0]) if _INT_TEXT.fullmatch(text) else None
    return None


def _lax_int(raw: msgspec.Raw) -> int | None:
    return _lax_int_value(_scalar(raw))


def _newer(raw: msgspec.Raw, older: int | None) -> int | None:
    """The newer max-tokens field wins when it holds a number."""
    value = _lax_int(raw)
    return older if value is None else value


def _lax_salt(raw: msgspec.Raw) -> str | None:
    value = _scalar(raw)
    return value if isinstance(value, str) and 0 < len(value) <= 1024 else None


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
    """The prompt of a loosely decoded body, and the API's newer max-tokens field."""
    if api is Api.COMPLETIONS:
        return _loose_prompt_text(loose.prompt, "prompt", refusal), None
    if api is Api.EMBEDDINGS:
        return _loose_prompt_text(loose.input, "input", refusal), None
    if api is Api.CHAT_COMPLETIONS:
        if not isinstance(loose.messages, list | None):
            raise EppError(Reason.BAD_REQUEST, refusal)
        messages = [_loose_turn(item, refusal) for item in loose.messages or []]
        return "".join(messages), _lax_int(loose.max_completion_tokens)
    head = f"<|system|>\n{loose.instructions}\n" if isinstance(loose.instructions, str) and loose.instructions else ""
    if isinstance(loose.input, str):
        return f"{head}<|user|>\n{loose.input}\n", _lax_int(loose.max_output_tokens)
    items = loose.input if isinstance(loose.input, list) else []
    turns = [_loose_turn(item, None) for item in items if isinstance(item, dict)]
    return head + "".join(turns), _lax_int(loose.max_output_tokens)


def _loose_turn(item: object, refusal: str | None) -> str:
    """One chat message or Responses item as plain JSON; ``refusal`` set: a role is required."""
    fields = item if isinstance(item, dict) else {}
    role = fields.get("role")
    if refusal is not None and not isinstance(role, str):
        raise EppError(Reason.BAD_REQUEST, refusal)
    marker = role if isinstance(role, str) and role else fields.get("type") or "user"
    content = fields.get("content")
    if isinstance(content, list):
        text = "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    else:
        text = content if isinstance(content, str) else ""
    return f"<|{marker}|>\n{text}\n"


def _loose_prompt_text(value: object, name: str, refusal: str) -> str:
    """A completions ``prompt`` / embeddings ``input`` in any form vLLM's union takes in lax mode
    (``list[int] | list[list[int]] | str | list[str]``: token ids may be written ``"1"``, ``1.0``,
    ``true``); a form it refuses keeps the picker's 400."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise EppError(Reason.BAD_REQUEST, refusal)
    if all(isinstance(item, str) for item in value):
        return "\n".join(cast(list[str], value))
    ids = _lax_ids(value)
    if ids is not None:
        return _token_text(ids)
    if all(isinstance(item, list) for item in value):
        nested = [_lax_ids(item) for item in cast(list[list[object]], value)]
        if all(item is not None for item in nested):
            return "\n".join(_token_text(item) for item in nested if item is not None)
    raise EppError(
        Reason.BAD_REQUEST,
        f"invalid request body: `{name}` must be a string, a list of strings, a list of token ids "
        "or a list of token-id lists, not a mix",
    )


def _lax_ids(items: list[object]) -> list[int] | None:
    ids = [_lax_int_value(item) for item in items]
    return None if any(i is None for i in ids) else cast(list[int], ids)


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
        return _loose_prompt_text(value, name, "")
    kind = kinds.pop()
    # One kind of item throughout (checked above): the casts name which.
    if kind is str:
        return "\n".join(cast(list[str], value))
    if kind is int:
        return _token_text(cast(list[int], value))
    return "\n".join(_token_text(ids) for ids in cast(list[list[int]], value))


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
