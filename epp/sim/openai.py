"""The OpenAI wire format a simulated pod reads and writes: request bodies, their prompts, error bodies.

Shared by the generation endpoints (:mod:`epp.sim.server`) and the token endpoints (:mod:`epp.sim.render`),
so that ``/tokenize`` and ``/v1/completions/render`` see exactly the prompt tokens a generation request
with the same body would: the prefix cache and the token endpoints agree, as on vLLM.

Bodies are decoded with msgspec into the structs below; fields the simulator does not model are accepted
and ignored (msgspec skips unknown fields). A prompt the simulator cannot take raises :class:`BadRequest`.
Errors are vLLM's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import msgspec
import numpy as np
from aiohttp import web

from epp.sim.tokens import model_prompts, render_chat, render_completion

__all__ = [
    "BadRequest",
    "ChatBody",
    "CompletionBody",
    "GenerationBody",
    "Message",
    "Part",
    "StreamOptions",
    "chat_prompt",
    "completion_prompts",
    "error_response",
    "json_response",
]

encode = msgspec.json.encode


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class GenerationBody(msgspec.Struct, kw_only=True):
    """The fields every generation request shares."""

    model: str = ""  # vLLM serves a request without a model with its (first) served model
    max_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class CompletionBody(GenerationBody):
    prompt: str | list[str | int]


class Part(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[Part] | None = None


class ChatBody(GenerationBody):
    messages: list[Message]
    max_completion_tokens: int | None = None


class BadRequest(Exception):
    """A body the simulator cannot serve; the message says why (answered with 400)."""


def completion_prompts(
    prompt: str | list[str | int], *, tokenizer: str | None = None, body: bytes = b""
) -> list[np.ndarray]:
    """Prompt token ids of a completions ``prompt``: one array per choice. With ``tokenizer`` (a model
    directory, ``EngineConfig.tokenizer``), the model's tokenizer reads the request ``body``."""
    if tokenizer is not None:
        try:
            return model_prompts(tokenizer, "completions", body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    if isinstance(prompt, str):
        return [render_completion(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [render_completion(p) for p in prompt if isinstance(p, str)]
    if prompt and all(isinstance(p, int) and 0 <= p < 2**32 for p in prompt):
        return [np.array(prompt, dtype=np.uint32)]
    raise BadRequest("prompt must be a string, a non-empty list of strings or a list of token ids")


def chat_prompt(
    messages: list[Message], *, add_generation_prompt: bool = True, tokenizer: str | None = None, body: bytes = b""
) -> np.ndarray:
    """Prompt token ids of a chat ``messages`` list, through the simulator's chat template, or with
    ``tokenizer`` (a model directory) through the model's tokenizer and template, from the ``body``."""
    if tokenizer is not None:
        try:
            return model_prompts(tokenizer, "chat_completions", body)[0]
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
    if not messages:
        raise BadRequest("messages must not be empty")
    rendered: list[tuple[str, str]] = []
    for m in messages:
        if m.content is None or isinstance(m.content, str):
            rendered.append((m.role, m.content or ""))
            continue
        texts = []
        for part in m.content:
            if part.type != "text" or part.text is None:
                raise BadRequest(f"unsupported content part type {part.type!r}: the simulator takes text only")
            texts.append(part.text)
        rendered.append((m.role, "\n".join(texts)))
    return render_chat(rendered, add_generation_prompt=add_generation_prompt)


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """vLLM's error body with ``status``."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.Response(status=status, body=encode(body), content_type="application/json")


def json_response(obj: object) -> web.Response:
    """``obj`` as a 200 JSON response."""
    return web.Response(body=encode(obj), content_type="application/json")
