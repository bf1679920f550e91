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

Two inputs msgspec handles differently from the model server, handled at this boundary:

- **Deep nesting.** msgspec's decoder recurses per nesting level, also while skipping a field no
  struct declares, and stops with ``RecursionError`` near Python's recursion limit (about 1,000
  levels). That is a 400 saying the body nests too deeply, never a 500: vLLM's own parser
  (``json.loads`` under FastAPI) has the same limit, so no body vLLM accepts is refused.
- **What json.loads accepts and msgspec does not**: lone surrogate escapes (``"\\ud800"`` with no
  low half, which msgspec reports as "Input data was truncated"), ``NaN`` and ``Infinity``. vLLM
  parses bodies with ``json.loads`` (FastAPI), so it accepts them, and the picker must too. So a
  body msgspec refuses as JSON (not as UTF-8) is decoded again by ``json.loads`` and converted into
  the same struct by ``msgspec.convert`` (a slow path only such bodies take). If ``json.loads``
  refuses it too, the 400 gives msgspec's message (it names the byte), or ``json.loads``' when the
  body holds a surrogate escape (msgspec's would say "truncated"). The strings the picker keeps
  from such a body have each lone surrogate replaced by U+FFFD, so that they can always be encoded
  (headers, metric labels, logs). The body sent on to the pod is never changed.

Which struct to decode into is chosen by the request path (``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/responses``); any other path with a body only
needs a string ``model``. Body-less requests (``GET /v1/models``) are routed too, with no model.

``prompt`` is the text later hashed for prefix-cache affinity. Chat messages and Responses-API
items are rendered deterministically (role markers + content parts) so the same conversation
always yields the same text, and a conversation that grows keeps its earlier text as a prefix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, cast

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
    decoder = _DECODERS[api]
    try:
        parsed: _Common | _LooseBody = decoder.decode(body)
    except msgspec.ValidationError as exc:
        refusal = f"invalid request body for {path}: {exc}"
        try:
            parsed = _loose_decode(path, body, exc)
        except msgspec.DecodeError as again:  # msgspec validates as it reads: not JSON after all
            parsed = _not_msgspec_json(decoder, path, body, again)
    except RecursionError as exc:
        raise EppError(Reason.BAD_REQUEST, _TOO_DEEP) from exc
    except msgspec.DecodeError as exc:
        parsed = _not_msgspec_json(decoder, path, body, exc)

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
        body=body,
    )


def _not_msgspec_json(decoder: msgspec.json.Decoder[Any], path: str, body: bytes, exc: msgspec.DecodeError) -> _Common:
    """A body msgspec refuses as JSON: a 400 when it is not UTF-8; else the slow path for what
    json.loads accepts and msgspec does not (lone surrogates, NaN), a 400 if json.loads refuses too."""
    text = str(exc)
    if "UTF-8" in text:
        raise EppError(Reason.BAD_REQUEST, "request body is not valid UTF-8") from exc
    return _without_lone_surrogates(_decode_leniently(decoder.type, path, body, text))


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
    except RecursionError as deep:
        raise EppError(Reason.BAD_REQUEST, _TOO_DEEP) from deep
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


_TOO_DEEP = "request body nests too deeply (JSON nested about 1,000 levels or more)"

# A \uD800-\uDFFF escape: where msgspec's message misleads ("Input data was truncated").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _decode_leniently(target: Any, path: str, body: bytes, refusal: str) -> _Common:
    # json.loads, not msgspec: it is what vLLM (FastAPI) parses with, so it accepts exactly what
    # vLLM accepts; msgspec.convert then applies the same typed view.
    try:
        # Keys cleaned: msgspec.convert cannot match a key holding a lone surrogate to a field (it
        # raises UnicodeEncodeError); no field name has one, so cleaning them changes no match.
        value = json.loads(body, object_pairs_hook=_clean_keys)
    except RecursionError as exc:
        raise EppError(Reason.BAD_REQUEST, _TOO_DEEP) from exc
    except UnicodeDecodeError as exc:
        raise EppError(Reason.BAD_REQUEST, "request body is not valid UTF-8") from exc
    except ValueError as exc:
        message = str(exc) if _SURROGATE_ESCAPE.search(body) else refusal
        raise EppError(Reason.BAD_REQUEST, f"request body is not valid JSON: {message}") from exc
    try:
        return cast(_Common, msgspec.convert(value, target))
    except msgspec.ValidationError as exc:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: {exc}") from exc
    except RecursionError as exc:
        raise EppError(Reason.BAD_REQUEST, _TOO_DEEP) from exc


def _clean(text: str) -> str:
    # Lone surrogates cannot be encoded as UTF-8; U+FFFD stands in for each in the picker's view.
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _clean_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return {_clean(key): value for key, value in pairs}


def _clean_content(content: _Content) -> _Content:
    if isinstance(content, str):
        return _clean(content)
    if isinstance(content, list):
        return [_Part(_clean(p.type), None if p.text is None else _clean(p.text)) for p in content]
    return content


def _clean_prompt(value: str | list[str | int | list[int]]) -> str | list[str | int | list[int]]:
    if isinstance(value, str):
        return _clean(value)
    return [_clean(item) if isinstance(item, str) else item for item in value]


def _without_lone_surrogates(parsed: _Common) -> _Common:
    """``parsed`` with every string routing reads cleaned by :func:`_clean`."""
    changes: dict[str, Any] = {"model": _clean(parsed.model) if parsed.model is not None else None}
    if parsed.cache_salt is not None:
        changes["cache_salt"] = _clean(parsed.cache_salt)
    if isinstance(parsed, _Completion):
        changes["prompt"] = _clean_prompt(parsed.prompt)
    elif isinstance(parsed, _Embedding):
        changes["input"] = _clean_prompt(parsed.input)
    elif isinstance(parsed, _ChatCompletion):
        changes["messages"] = [_ChatMessage(_clean(m.role), _clean_content(m.content)) for m in parsed.messages]
    elif isinstance(parsed, _Response):
        if parsed.instructions is not None:
            changes["instructions"] = _clean(parsed.instructions)
        if not isinstance(parsed.input, str):
            changes["input"] = [
                _ResponseItem(
                    None if i.type is None else _clean(i.type),
                    None if i.role is None else _clean(i.role),
                    _clean_content(i.content),
                )
                for i in parsed.input
            ]
        else:
            changes["input"] = _clean(parsed.input)
    return msgspec.structs.replace(parsed, **changes)


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
