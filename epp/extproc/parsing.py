"""What the picker knows about one inference request: parsed once, read by every plugin.

Design
------
The body of an OpenAI-style request is decoded exactly once, by msgspec, straight into small typed
structs that declare only the fields routing needs (``model``, the prompt-bearing field, ``stream``,
``cache_salt``...). Unknown fields are skipped by the C decoder without building Python objects, so
a 400 KB prompt costs about a hundred microseconds and no per-character Python work. msgspec also
rejects invalid UTF-8, malformed JSON and wrongly typed fields with a message that names the field
(``Expected `str`, got `int` - at `$.model```), which becomes the client's 400 message.

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
    request_id, method = headers.get("x-request-id", ""), headers.get(":method", "")
    if not body:
        if api is not Api.OTHER:
            raise EppError(Reason.BAD_REQUEST, f"{path} needs a JSON body with a `model` field")
        return InferenceRequest(request_id, method, path, headers, api)

    parsed, lone_surrogates = _decode(api, path, body)
    if lone_surrogates:
        parsed = _without_lone_surrogates(parsed)
    if not parsed.model:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: `model` must not be empty")
    max_tokens = parsed.max_tokens
    prompt = ""
    if isinstance(parsed, _Completion):
        prompt = _prompt_text(parsed.prompt, "prompt")
    elif isinstance(parsed, _ChatCompletion):
        prompt = _render_messages(parsed.messages)
        if parsed.max_completion_tokens is not None:
            max_tokens = parsed.max_completion_tokens
    elif isinstance(parsed, _Embedding):
        prompt = _prompt_text(parsed.input, "input")
    elif isinstance(parsed, _Response):
        prompt = _render_response_input(parsed)
        if parsed.max_output_tokens is not None:
            max_tokens = parsed.max_output_tokens
    return InferenceRequest(
        request_id,
        method,
        path,
        headers,
        api,
        model=parsed.model,
        adapter=None if parsed.model in base_models else parsed.model,
        prompt=prompt,
        stream=bool(parsed.stream),
        cache_salt=parsed.cache_salt,
        max_tokens=max_tokens,
        body_size=len(body),
    )


_TOO_DEEP = "request body nests too deeply (JSON nested about 1,000 levels or more)"

# A \uD800-\uDFFF escape: where msgspec's message misleads ("Input data was truncated").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _decode(api: Api, path: str, body: bytes) -> tuple[_Common, bool]:
    """The typed view of ``body``, and whether it was decoded by the json.loads slow path."""
    decoder = _DECODERS[api]
    try:
        return decoder.decode(body), False
    except msgspec.ValidationError as exc:
        raise EppError(Reason.BAD_REQUEST, f"invalid request body for {path}: {exc}") from exc
    except RecursionError as exc:
        raise EppError(Reason.BAD_REQUEST, _TOO_DEEP) from exc
    except msgspec.DecodeError as exc:
        text = str(exc)
        if "UTF-8" in text:
            raise EppError(Reason.BAD_REQUEST, "request body is not valid UTF-8") from exc
        return _decode_leniently(decoder.type, path, body, text), True


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
    changes: dict[str, Any] = {"model": _clean(parsed.model)}
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
