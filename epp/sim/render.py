"""The token endpoints of one simulated pod: ``/tokenize`` and vLLM 0.32's scale-out render endpoints.

* ``POST /tokenize`` takes a completions body (``prompt``: a string; ``add_special_tokens``, default true,
  puts BOS first) or a chat body (``messages``; ``add_generation_prompt``, default true) and answers
  ``{"count", "max_model_len", "tokens", "token_strs"}`` as vLLM does, with the very token ids a generation
  request of that prompt would get (:mod:`epp.sim.openai`), so a router may compute the pod's block hashes.
  ``token_strs`` (``return_token_strs``) is given for string prompts only: the simulator's chat template
  has no text form (with the model's own tokenizer, ``EngineConfig.tokenizer``, for both).
* ``POST /v1/completions/render`` and ``POST /v1/chat/completions/render`` (and the other scale-out routes
  of vLLM 0.32: ``/v1/messages/render``, ``/v1/responses/render``, the ``.../derender`` pair and
  ``/inference/v1/generate``) answer 403 ``PermissionDeniedError`` unless the pod runs with
  ``enable_scale_out`` (vLLM's ``--enable-scale-out``; vllm/entrypoints/scale_out/factories.py registers
  a 403 handler on each of those paths otherwise). Enabled, the two render endpoints answer vLLM's
  ``GenerateRequest`` shape (a list of them for completions, one per prompt) with the prompt's
  ``token_ids``; the other routes answer 501, as the simulator does not model them.

A body naming a model the pod does not serve is a 404; ``model`` may be left out (the base model).
"""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
from aiohttp import web

from epp.sim.engine import Engine
from epp.sim.openai import (
    BadRequest,
    ChatBody,
    CompletionBody,
    Message,
    chat_prompt,
    completion_prompts,
    error_response,
    json_response,
)
from epp.sim.tokens import BYTES_PER_TOKEN, model_tokenizer

__all__ = ["RENDER_PATHS", "SCALE_OUT_PATHS", "add_token_routes"]

RENDER_PATHS = ("/v1/completions/render", "/v1/chat/completions/render")
"""The render endpoints the simulator implements when scale-out is enabled."""
SCALE_OUT_PATHS = (*RENDER_PATHS, "/v1/messages/render", "/v1/responses/render", "/v1/chat/completions/derender",
                   "/v1/completions/derender", "/inference/v1/generate")
"""Every POST route vLLM 0.32 answers with 403 unless ``--enable-scale-out`` (render, derender, generate)."""

_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
_BOS_TEXT = "<|begin_of_text|>"


class _TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


def _serves(request: web.Request, model: str | None) -> web.Response | None:
    """None if the pod serves ``model`` (or it is not given), else the 404 vLLM answers."""
    if model is None or request.app[_ENGINE].serves(model):
        return None
    return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")


def _token_strs(prompt: str, with_bos: bool) -> list[str]:
    data = prompt.encode()
    chunks = [data[i:i + BYTES_PER_TOKEN].decode(errors="replace") for i in range(0, len(data), BYTES_PER_TOKEN)]
    return [_BOS_TEXT, *chunks] if with_bos else chunks


async def _tokenize(request: web.Request) -> web.Response:
    raw = await request.read()
    tokenizer = request.app[_ENGINE].config.tokenizer
    try:
        body = msgspec.json.decode(raw, type=_TokenizeBody)
    except msgspec.DecodeError as exc:
        return error_response(400, f"invalid request body: {exc}", "BadRequestError")
    if (refused := _serves(request, body.model)) is not None:
        return refused
    strs: list[str] | None = None
    try:
        if tokenizer is not None and (body.prompt is None) != (body.messages is None):
            ids = (completion_prompts(body.prompt, tokenizer=tokenizer, body=raw)[0] if body.prompt is not None
                   else chat_prompt([], tokenizer=tokenizer, body=raw))  # fmt: skip
            if body.return_token_strs:
                backend = model_tokenizer(tokenizer).backend
                strs = [backend.id_to_token(int(i)) or "" for i in ids]
        elif body.prompt is not None and body.messages is None:
            with_bos = body.add_special_tokens is not False
            ids = completion_prompts(body.prompt)[0]
            ids = ids if with_bos else ids[1:]
            if body.return_token_strs:
                strs = _token_strs(body.prompt, with_bos)
        elif body.messages is not None and body.prompt is None:
            ids = chat_prompt(body.messages, add_generation_prompt=body.add_generation_prompt)
            if body.return_token_strs:
                raise BadRequest("return_token_strs: the simulator's chat template has no text form")
        else:
            raise BadRequest("give either prompt or messages")
    except BadRequest as exc:
        return error_response(400, str(exc), "BadRequestError")
    tokens = ids.tolist()
    return json_response({"count": len(tokens), "max_model_len": request.app[_ENGINE].config.max_model_len,
                          "tokens": tokens, "token_strs": strs})


_render_ids = itertools.count(1)


def _generate_request(model: str, ids: np.ndarray, max_tokens: int | None, stream: bool) -> dict[str, object]:
    # vLLM's GenerateRequest (scale_out/token_in_token_out/protocol.py), with the fields a render fills.
    return {"request_id": f"render-{next(_render_ids)}", "token_ids": ids.tolist(), "token_offsets": None,
            "features": None, "content_parts": None, "sampling_params": {"max_tokens": max_tokens},
            "model": model, "stream": stream, "cache_salt": None, "priority": 0, "kv_transfer_params": None}


async def _render(request: web.Request) -> web.Response:
    if not request.app[_ENGINE].config.enable_scale_out:
        return error_response(403, _DISABLED, "PermissionDeniedError")
    chat = request.path == "/v1/chat/completions/render"
    raw = await request.read()
    tokenizer = request.app[_ENGINE].config.tokenizer
    try:
        body = msgspec.json.decode(raw, type=ChatBody if chat else CompletionBody)
    except msgspec.DecodeError as exc:
        return error_response(400, f"invalid request body: {exc}", "BadRequestError")
    if (refused := _serves(request, body.model)) is not None:
        return refused
    try:
        if isinstance(body, ChatBody):
            max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
            ids = chat_prompt(body.messages, tokenizer=tokenizer, body=raw)
            return json_response(_generate_request(body.model, ids, max_tokens, body.stream))
        prompts = completion_prompts(body.prompt, tokenizer=tokenizer, body=raw)
    except BadRequest as exc:
        return error_response(400, str(exc), "BadRequestError")
    return json_response([_generate_request(body.model, ids, body.max_tokens, body.stream) for ids in prompts])


async def _other_scale_out(request: web.Request) -> web.Response:
    if not request.app[_ENGINE].config.enable_scale_out:
        return error_response(403, _DISABLED, "PermissionDeniedError")
    return error_response(501, f"{request.path} is not simulated", "NotImplementedError")


_ENGINE = web.AppKey("token_routes_engine", Engine)


def add_token_routes(app: web.Application, engine: Engine) -> None:
    """Add ``/tokenize`` and the scale-out routes of ``engine``'s pod to its app."""
    app[_ENGINE] = engine
    app.router.add_post("/tokenize", _tokenize)
    for path in SCALE_OUT_PATHS:
        app.router.add_post(path, _render if path in RENDER_PATHS else _other_scale_out)
