"""The OpenAI-compatible HTTP API of one simulated pod: the part of vLLM's server that routers and clients use.

Endpoints
---------
* ``POST /v1/completions`` (``prompt``: a string, a list of strings (one choice each) or a list of token ids)
  and ``POST /v1/chat/completions`` (``messages`` with string content or ``[{"type": "text", "text": ...}]``
  parts). Both honour ``model``, ``max_tokens`` (chat also ``max_completion_tokens``), ``ignore_eos``,
  ``stream`` and ``stream_options.include_usage``; ``n`` must be 1; other sampling fields are accepted and
  ignored. Non-streaming responses are one JSON object with ``usage``; streaming responses are Server-Sent
  Events, one ``data: {...}`` chunk per generated token as the engine produces it (chat starts with a role
  chunk, sent with the first token, after the prefill, as vLLM does), then a usage chunk with empty
  ``choices`` if asked, then ``data: [DONE]``.
* ``GET /v1/models`` (base model and served adapters), ``GET /health``, ``GET /metrics``
  (:mod:`epp.sim.metrics`; as in vLLM 0.32 it ignores ``?name[]=``, while ``GET /metrics/`` serves the same
  page restricted to the names asked, as prometheus_client's app does), and vLLM's runtime adapter
  endpoints ``POST /v1/load_lora_adapter`` and
  ``POST /v1/unload_lora_adapter`` (``{"lora_name": ..., "lora_path": ...}``; need LoRA enabled).
* ``GET /kv_event_sources`` (the KV-event publisher per data-parallel rank, ``{}`` when off), ``POST
  /reset_prefix_cache`` (vLLM's dev-mode route: ``{"success": bool}``, false while requests hold blocks
  unless ``?reset_running_requests=true``; published as ``AllBlocksCleared`` with the next engine step),
  ``POST /tokenize`` and the scale-out render endpoints (403 unless ``enable_scale_out``):
  :mod:`epp.sim.render`.
* Errors are OpenAI-style ``{"error": {"message", "type", "param", "code"}}``: 400 for a malformed body or an
  invalid request, 404 for an unknown model, 503 when the pod shuts down mid-request.

Headers for tests of a router: every response carries ``x-sim-pod: <pod name>``; every response to a POST
carries ``x-sim-body-sha256`` (SHA-256 of the body as received) and ``x-sim-prefix-hit-tokens`` (prompt tokens
found in the prefix cache when the request was admitted; 0 if it never was). Because of the latter, a
streaming response sends its headers when the request is admitted to the batch, not when it arrives. A pod
of a pool of several in one process (:class:`~epp.sim.pool.SimulatedPool`) adds ``x-sim-held-at-arrival:
<own> <best>``: the prompt tokens this pod, and the pod of the pool holding the most, had cached when the
request arrived (:meth:`~epp.sim.engine.Engine.held_at_arrival`): how close a router came to the best
choice the caches of that moment offered.

A client that disconnects aborts its request (``finished_reason="abort"``), as with vLLM.

Test-only switches, off unless asked for (:mod:`epp.sim.faults`): a control endpoint that breaks the metrics
page on demand, and a record of every request received.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from epp.sim.engine import Engine
from epp.sim.exposition import CONTENT_TYPE, restrict_page
from epp.sim.faults import FaultSwitches, RequestRecorder, add_fault_routes, broken_metrics, recording
from epp.sim.metrics import HttpStats, MetricsPage
from epp.sim.openai import (
    BadRequest,
    ChatBody,
    CompletionBody,
    chat_prompt,
    completion_prompts,
    error_response,
    json_response,
)
from epp.sim.render import add_token_routes
from epp.sim.request import SimRequest, Sink

__all__ = ["build_app"]

_MAX_BODY = 16 << 20  # bytes; prompts of a few hundred KB are expected, keep headroom
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class _AdapterBody(msgspec.Struct):
    lora_name: str
    lora_path: str = ""


_ENGINE = web.AppKey("engine", Engine)
_POD = web.AppKey("pod", str)
_HTTP = web.AppKey("http", HttpStats)
_PAGE = web.AppKey("page", MetricsPage)
_FAULTS = web.AppKey("faults", FaultSwitches)
_SHA = web.RequestKey("sha", str)
_HITS = web.RequestKey("prefix_hits", int)
_HELD = web.RequestKey("held_at_arrival", tuple)  # (this pod's, the pool's best): Engine.held_at_arrival

_encode = msgspec.json.encode


async def _read_body(request: web.Request) -> bytes:
    body = await request.read()
    request[_SHA] = hashlib.sha256(body).hexdigest()
    return body


def _usage(reqs: list[SimRequest]) -> dict[str, int]:
    prompt = sum(r.prompt_len for r in reqs)
    completion = sum(r.num_output for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Generation:
    """One generation HTTP request: its engine requests and how to render them."""

    def __init__(self, request: web.Request, chat: bool) -> None:
        self.request = request
        self.chat = chat
        self.engine = request.app[_ENGINE]
        self.sink = Sink()
        self.reqs: list[SimRequest] = []
        self.created = int(time.time())
        self.model = ""
        self.id = ""

    async def handle(self) -> web.StreamResponse:
        body = await _read_body(self.request)
        try:
            # Lax like vLLM's pydantic models: "3" and 3.0 are 3, "false" is False.
            parsed = msgspec.json.decode(body, type=ChatBody if self.chat else CompletionBody, strict=False)
        except msgspec.DecodeError as exc:
            return error_response(400, f"invalid request body: {exc}", "BadRequestError")
        if not parsed.model:
            parsed.model = self.engine.config.model
        if not self.engine.serves(parsed.model):
            return error_response(404, f"The model `{parsed.model}` does not exist.", "NotFoundError", "model")
        max_tokens = parsed.max_tokens
        try:
            if parsed.n != 1:
                raise BadRequest("the simulator supports n=1 only")
            tokenizer = self.engine.config.tokenizer
            if isinstance(parsed, ChatBody):
                prompts = [chat_prompt(parsed.messages, tokenizer=tokenizer, body=body)]
                if parsed.max_completion_tokens is not None:
                    max_tokens = parsed.max_completion_tokens
            else:
                prompts = completion_prompts(parsed.prompt, tokenizer=tokenizer, body=body)
            self.reqs = [
                self.engine.new_request(parsed.model, ids, max_tokens=max_tokens, ignore_eos=parsed.ignore_eos,
                                        sink=self.sink)
                for ids in prompts
            ]
        except (BadRequest, ValueError) as exc:
            return error_response(400, str(exc), "BadRequestError")
        self.model = parsed.model
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{self.request.app[_POD]}-{self.reqs[0].request_id}"
        if len(self.engine.peers) > 1:
            held = [self.engine.held_at_arrival(r) for r in self.reqs]
            self.request[_HELD] = (sum(h[0] for h in held), sum(h[1] for h in held))
        for req in self.reqs:
            self.engine.submit(req)
        try:
            if parsed.stream:
                options = parsed.stream_options
                return await self._stream(options is not None and options.include_usage)
            return await self._complete()
        finally:
            for req in self.reqs:
                if not req.finished:
                    self.engine.abort(req)

    def _record_hits(self) -> None:
        self.request[_HITS] = sum(r.prefix_hit_tokens or 0 for r in self.reqs)

    async def _complete(self) -> web.StreamResponse:
        while not all(r.finished for r in self.reqs):
            await self.sink.wait()
        self._record_hits()
        if any(r.finish_reason == "abort" for r in self.reqs):
            return error_response(503, "the simulated pod shut down before the request finished",
                                  "ServiceUnavailableError")
        if self.chat:
            choices: list[dict[str, object]] = [
                {"index": i, "message": {"role": "assistant", "content": r.text()}, "logprobs": None,
                 "finish_reason": r.finish_reason}
                for i, r in enumerate(self.reqs)
            ]
        else:
            choices = [
                {"index": i, "text": r.text(), "logprobs": None, "finish_reason": r.finish_reason, "stop_reason": None}
                for i, r in enumerate(self.reqs)
            ]
        obj = "chat.completion" if self.chat else "text_completion"
        return json_response({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                      "choices": choices, "usage": _usage(self.reqs)})

    def _chunk(self, choices: list[dict[str, object]], **extra: object) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        chunk.update(extra)
        return b"data: " + _encode(chunk) + b"\n\n"

    def _token_chunk(self, index: int, text: str, finish_reason: str | None) -> bytes:
        if self.chat:
            choice: dict[str, object] = {"index": index, "delta": {"content": text}, "logprobs": None,
                                         "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                      "stop_reason": None}
        return self._chunk([choice])

    async def _stream(self, include_usage: bool) -> web.StreamResponse:
        # The prefix-hit header is known at admission: wait for it before the headers go out.
        while not all(r.prefix_hit_tokens is not None or r.finished for r in self.reqs):
            await self.sink.wait()
        self._record_hits()
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(self.request)
        # Like vLLM, the chat role chunk goes out with the first token, after the prefill: a client
        # (or a router watching the response) sees the first body bytes when generation starts.
        role_sent = [not self.chat] * len(self.reqs)
        sent = [0] * len(self.reqs)
        while True:
            out = []
            for i, r in enumerate(self.reqs):
                upto = r.num_output
                if not role_sent[i] and (upto or r.finished):
                    role_sent[i] = True
                    out.append(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]))
                for k in range(sent[i], upto):
                    last = r.finished and k == upto - 1
                    out.append(self._token_chunk(i, r.plan.words[k], r.finish_reason if last else None))
                sent[i] = upto
            if out:
                await resp.write(b"".join(out))
            if all(r.finished for r in self.reqs):
                break
            await self.sink.wait()
        if include_usage:
            await resp.write(self._chunk([], usage=_usage(self.reqs)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _Generation(request, chat=False).handle()


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _Generation(request, chat=True).handle()


async def _models(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    cfg = engine.config
    created = int(engine.stats.created)

    def card(name: str, parent: str | None) -> dict[str, object]:
        return {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
                "parent": parent, "max_model_len": cfg.max_model_len}

    data = [card(cfg.model, None)] + [card(a, cfg.model) for a in engine.adapters]
    return json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def _kv_event_sources(request: web.Request) -> web.Response:
    # vLLM 0.32 (serve/instrumentator/basic.py): the KV-event publisher config per data-parallel rank,
    # the fields of its KVEventsConfig; {} when KV events are off.
    return json_response(request.app[_ENGINE].kv_event_sources())


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() in ("true", "1", "yes", "on")


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    # vLLM 0.32's dev-mode route (serve/dev/cache/api_router.py; served by vLLM only with
    # VLLM_SERVER_DEV_MODE=1, always here): {"success": false} while requests hold blocks, unless
    # ?reset_running_requests=true preempts them first.
    await _read_body(request)
    done = request.app[_ENGINE].reset_prefix_cache(_flag(request, "reset_running_requests"))
    return json_response({"success": done})


async def _metrics(request: web.Request) -> web.Response:
    # vLLM 0.32's /metrics is prometheus-fastapi-instrumentator's handler: it ignores ?name[]=.
    if (broken := await _broken(request)) is not None:
        return broken
    return web.Response(body=request.app[_PAGE].render(), headers={"Content-Type": CONTENT_TYPE})


async def _metrics_app(request: web.Request) -> web.Response:
    # vLLM 0.32's /metrics/ is prometheus_client's own ASGI app: the same page, and it serves only the
    # samples ?name[]= asks for.
    if (broken := await _broken(request)) is not None:
        return broken
    page = request.app[_PAGE].render()
    names = request.query.getall("name[]", [])
    if names:
        page = restrict_page(page, [name.encode() for name in names])
    return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE})


async def _broken(request: web.Request) -> web.Response | None:
    switches = request.app.get(_FAULTS)
    return None if switches is None else await broken_metrics(switches)


async def _adapter_body(request: web.Request) -> _AdapterBody:
    try:
        return msgspec.json.decode(await _read_body(request), type=_AdapterBody)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid request body: {exc}") from exc


async def _load_adapter(request: web.Request) -> web.Response:
    engine = request.app[_ENGINE]
    try:
        body = await _adapter_body(request)
    except BadRequest as exc:
        return error_response(400, str(exc), "BadRequestError")
    if not engine.config.lora_enabled:
        return error_response(400, "LoRA is not enabled on this pod (start it with LoRA adapters or enable_lora)",
                      "BadRequestError")
    if not engine.load_adapter(body.lora_name):
        return error_response(400, f"The lora adapter '{body.lora_name}' has already been loaded.", "InvalidUserInput")
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def _unload_adapter(request: web.Request) -> web.Response:
    try:
        body = await _adapter_body(request)
    except BadRequest as exc:
        return error_response(400, str(exc), "BadRequestError")
    if not request.app[_ENGINE].unload_adapter(body.lora_name):
        return error_response(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError")
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _instrument(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Account the request in the HTTP metrics (as prometheus-fastapi-instrumentator does; not /metrics)."""
    app = request.app
    loop_time = app[_ENGINE].now
    start = loop_time()
    status, size = 500, 0
    try:
        resp = await handler(request)
        status = resp.status
        size = resp.content_length if resp.content_length is not None else resp.body_length
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "none"
        if route not in ("/metrics", "/metrics/"):
            app[_HTTP].record(route, request.method, status, request.content_length or 0, size, loop_time() - start)


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["x-sim-pod"] = request.app[_POD]
    if request.method == "POST":
        if _SHA not in request:  # a POST no handler read (unknown route, wrong method)
            await _read_body(request)
        response.headers["x-sim-body-sha256"] = request[_SHA]
        response.headers["x-sim-prefix-hit-tokens"] = str(request.get(_HITS, 0))
        if _HELD in request:
            own, best = request[_HELD]
            response.headers["x-sim-held-at-arrival"] = f"{own} {best}"


def build_app(
    engine: Engine, pod_name: str, *, fault_control: bool = False, recorder: RequestRecorder | None = None
) -> web.Application:
    """The aiohttp application of one pod (the engine is started and stopped by its owner).

    ``fault_control`` and ``recorder``: the test-only switches of :mod:`epp.sim.faults`."""
    middlewares: list[Middleware] = [_instrument] if recorder is None else [recording(recorder), _instrument]
    app = web.Application(middlewares=middlewares, client_max_size=_MAX_BODY)
    if fault_control:
        app[_FAULTS] = switches = FaultSwitches()
        add_fault_routes(app, switches)
    http = HttpStats()
    app[_ENGINE] = engine
    app[_POD] = pod_name
    app[_HTTP] = http
    app[_PAGE] = MetricsPage(engine, http)
    app.on_response_prepare.append(_on_prepare)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/kv_event_sources", _kv_event_sources)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/metrics/", _metrics_app)
    app.router.add_post("/v1/load_lora_adapter", _load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", _unload_adapter)
    add_token_routes(app, engine)
    return app
