"""Reading request fields as vLLM's pydantic models do in lax mode: the picker is never stricter.

Design
------
vLLM validates request bodies with pydantic in lax mode. Its request models
(vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py) declare
``stream: bool | None``, ``max_tokens: int | None`` (and ``max_completion_tokens``,
``max_output_tokens``), ``cache_salt: str | None`` of 1 to 1024 characters, and the prompt union
``list[int] | list[list[int]] | str | list[str]``. Lax mode takes ``"3"``, ``3.0``, ``"3.0"``, ``true``
for an int, and ``"false"``, ``"yes"``, ``"on"``, ``1``, ``0.0`` (any case) for a bool.

:mod:`epp.extproc.parsing` keeps those routing-only scalars as raw JSON (``msgspec.Raw``); the functions
here read them as pydantic would, and give None (the default) for what pydantic refuses: such a value
only means no routing hint, and vLLM answers the client itself. The common raw forms (``true``,
``false``, digits) are read without decoding. :func:`loose_prompt_text` and :func:`loose_turn` render
prompt-bearing fields of any JSON shape the typed structs could not decode; a prompt of no form vLLM
takes keeps the picker's 400.
"""

from __future__ import annotations

import re
from typing import cast

import msgspec

from epp.errors import EppError, Reason

__all__ = ["lax_bool", "lax_int", "lax_int_value", "lax_salt", "loose_prompt_text", "loose_turn", "newer", "token_text"]

# A routing scalar longer than this is no number, boolean or salt vLLM accepts (a salt is at most
# 1024 characters): it is not decoded at all.
_MAX_SCALAR_BYTES = 1100


# vLLM's request models (vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py)
# declare ``stream: bool | None``, ``max_tokens: int | None``, ``cache_salt: str | None`` (1 to 1024
# characters) and validate them in pydantic's lax mode; these functions accept what it accepts and
# give None (the default) for what it refuses, since such a value only means no routing hint.

_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT = re.compile(r"[+-]?[0-9](?:_?[0-9])*(?:\.0*)?")
_INT64_LIMIT = 2**63


def _decode(data: bytes | msgspec.Raw) -> object:
    """A raw field's JSON value; None when it cannot be decoded. The body's decode checked its
    structure, not every string in it: bytes that are not UTF-8 inside a nested value (a lone
    surrogate written as raw bytes) fail here, and such a value is simply no routing hint."""
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None


def _scalar(raw: msgspec.Raw) -> object:
    if not raw or len(raw) > _MAX_SCALAR_BYTES:
        return None
    return _decode(raw)


def lax_bool(raw: msgspec.Raw) -> bool:
    """A ``stream``-like flag: False when absent, null or of a form pydantic refuses."""
    if not raw or len(raw) > _MAX_SCALAR_BYTES:
        return False
    data = bytes(raw)
    if data == b"true":  # the forms nearly every client sends, without a decode
        return True
    if data == b"false":
        return False
    value = _decode(data)
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1  # pydantic takes 0, 1, 0.0 and 1.0; anything else is not a stream flag
    if isinstance(value, str):
        return value.lower() in _TRUE_WORDS
    return False


def lax_int_value(value: object) -> int | None:
    """A decoded JSON value as pydantic's lax int reads it; None where it refuses."""
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


def lax_int(raw: msgspec.Raw) -> int | None:
    """A ``max_tokens``-like number: None when absent, null or of a form pydantic refuses."""
    if not raw or len(raw) > _MAX_SCALAR_BYTES:
        return None
    data = bytes(raw)
    if data.isdigit():  # plain digits, the common form, without a decode
        return int(data)
    return lax_int_value(_decode(data))


def newer(raw: msgspec.Raw, older: int | None) -> int | None:
    """The newer max-tokens field wins when it holds a number."""
    value = lax_int(raw)
    return older if value is None else value


def lax_salt(raw: msgspec.Raw) -> str | None:
    """``cache_salt``: a string of 1 to 1024 characters, else None."""
    value = _scalar(raw)
    return value if isinstance(value, str) and 0 < len(value) <= 1024 else None


def loose_turn(item: object, refusal: str | None) -> str:
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


def loose_prompt_text(value: object, name: str, refusal: str) -> str:
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
        return token_text(ids)
    if all(isinstance(item, list) for item in value):
        nested = [_lax_ids(item) for item in cast(list[list[object]], value)]
        if all(item is not None for item in nested):
            return "\n".join(token_text(item) for item in nested if item is not None)
    raise EppError(
        Reason.BAD_REQUEST,
        f"invalid request body: `{name}` must be a string, a list of strings, a list of token ids "
        "or a list of token-id lists, not a mix",
    )


def _lax_ids(items: list[object]) -> list[int] | None:
    ids = [lax_int_value(item) for item in items]
    return None if any(i is None for i in ids) else cast(list[int], ids)


def token_text(ids: list[int]) -> str:
    """A token-id prompt as text."""
    # Token-id prompts have no text; their ids, written out, still share prefixes exactly when the
    # prompts do, which is all prefix affinity needs.
    return " ".join(map(str, ids))
