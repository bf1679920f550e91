"""A worker's director: routes through the owner process (:mod:`epp.requestcontrol.owner`).

Design
------
An ext_proc worker (:mod:`epp.server.workers`) runs :mod:`epp.extproc`'s stream handling unchanged,
with a :class:`RemoteDirector` in place of :class:`~epp.requestcontrol.director.Director`. It has the
attributes and methods the edge uses (``route``, ``tracing``, ``base_models``,
``datastore.endpoints()``), and :meth:`RemoteDirector.route` returns a :class:`RemoteRouted` with
:class:`~epp.requestcontrol.lifecycle.RoutedRequest`'s lifecycle methods. Nothing of routing runs
here: the parsed request goes to the owner as an :class:`~epp.requestcontrol.ipc.Route` and the
awaiting stream resumes on the owner's answer; the lifecycle calls become one-way messages.

* ``route``: one :class:`Route` out, one future awaited; the answer is a :class:`Routed`, or a
  :class:`Refusal` raised as the same :class:`~epp.errors.EppError` the owner's director raised
  (so the edge answers it exactly as in one process), or :class:`Failed` (an internal error). A
  stream cancelled while it waits (its client went away while queued in flow control) sends
  :class:`Cancel`: the owner cancels its admission wait, or finishes the request ``cancelled`` if the
  pick crossed the cancel on the way.
* ``response_headers``: when a configured plugin has a ``response_received`` hook (it may set
  response headers, as ``session-affinity-scorer`` does), the answer depends on the owner: one
  :class:`Headers` message, and the call returns a future the edge awaits before answering Envoy
  (the response chunks that arrive meanwhile wait in order behind it). With no such hook it returns
  None at once, nothing waits, and the headers ride with the next event (the owner reads only the
  status, and for a 503 whether the pod sent it, so only those are sent): the owner's side effects
  of a 404 or a 503 (the pod's model list re-read, the pod marked unreachable) happen at the first
  body bytes or the end of the response instead, which for such answers is at once.
* ``response_body_started``: one :class:`Started`; ``response_ended`` is kept and travels with
  :class:`Finish` (the owner's request only reads it when it finishes); ``finish``: one
  :class:`Finish`, exactly once. Three messages per request in all: the route, the first byte, the end.
* ``GET /v1/models`` is answered from the pool's union, which the owner pushes when it changes
  (:class:`Models`); ``base_models`` is empty here: the owner sets each request's ``adapter`` from its
  own pool's lists when the route arrives.
* Observed responses (``epp envoy-config --observe-responses``): a routed request's token names this
  worker and the request's id here (:func:`~epp.requestcontrol.ipc.worker_token`); a response
  observed on another worker is claimed there (:meth:`RemoteDirector.claim`, one posted
  :class:`Claim`), and the owner tells this worker (:class:`Claimed`), which lets its routing stream
  go without a :class:`Finish` (:mod:`epp.requestcontrol.owner` has the design).
* Refusals the edge answers (a bad body, and the owner's refusals as it raises them) are counted
  through :class:`RemoteMetrics` (one :class:`Refused` each), so the owner's metrics count every
  request exactly once.

Timing: the owner measures a request's durations (time to first byte, response time) from its pick
to when the events arrive; the events are posted (:meth:`epp.requestcontrol.ipc.Channel.post`), so
they arrive up to :data:`~epp.requestcontrol.ipc.LAZY_DELAY` (2 ms) and a loop turn after the worker
saw them: those series read up to about 2 ms long, and in-flight accounting releases a request as
much later.

Tracing: the worker makes the request's spans (``gateway.request``, ``epp.parse``, the
orchestration and response spans); the route carries the orchestration span's context, under which
the owner records ``epp.admission`` and ``epp.scheduling``, exported by the owner's own exporter
into the same trace.

If the owner goes away, every waiting route fails (500: the picker cannot route), and the worker
process exits (:mod:`epp.server.workers`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from epp.errors import EppError, Reason, Refusal
from epp.framework import InferenceRequest, Outcome, ServedModels
from epp.requestcontrol import ipc
from epp.requestcontrol.tracing import RequestTrace, Tracing

__all__ = ["RemoteDirector", "RemoteMetrics", "RemoteRouted"]

Send = Callable[[msgspec.Struct], None]


def _not_connected(message: msgspec.Struct) -> None:
    raise RuntimeError("the remote director is not connected to the owner process")


class _Primary:
    """What the edge reads of a remote pick's primary endpoint (its name and address)."""

    __slots__ = ("hostport", "name")

    def __init__(self, name: str, hostport: str) -> None:
        self.name = name
        self.hostport = hostport


class _PoolModels:
    """The pool's models as ``GET /v1/models`` reads them: one pseudo-endpoint holding the union."""

    __slots__ = ("name", "served")

    def __init__(self, served: ServedModels) -> None:
        self.name = "pool"
        self.served = served


class _ModelsView:
    """The ``datastore`` the edge asks for ``endpoints()`` (``GET /v1/models``): the owner's union."""

    __slots__ = ("_endpoints",)

    def __init__(self) -> None:
        self._endpoints: tuple[Any, ...] = ()

    def endpoints(self) -> tuple[Any, ...]:
        return self._endpoints

    def update(self, cards: list[dict[str, Any]] | None) -> None:
        self._endpoints = () if cards is None else (_PoolModels(ServedModels(entries=tuple(cards))),)


class RemoteDirector:
    """The director of a worker process (see the module docstring).

    ``send`` writes a message someone waits for to the owner (at the end of this loop turn), ``post``
    one nobody waits for (it may wait a little for company: :meth:`epp.requestcontrol.ipc.Channel.post`).
    ``wait_for_headers``: some plugin has a ``response_received`` hook, so response headers wait for
    the owner's answer. ``send_body``: some plugin reads ``request.body``, so it goes with the request.
    """

    def __init__(
        self,
        send: Send = _not_connected,
        post: Send | None = None,
        *,
        tracing: Tracing | None = None,
        wait_for_headers: bool = False,
        send_body: bool = False,
    ) -> None:
        self.send = send
        self.post = send if post is None else post
        self.tracing = tracing
        self.wait_for_headers = wait_for_headers
        self.send_body = send_body
        self.datastore = _ModelsView()
        self.base_models: frozenset[str] = frozenset()  # the owner sets adapters (see the module docstring)
        self._next_id = 0
        self._routes: dict[int, asyncio.Future[msgspec.Struct]] = {}
        self._headers: dict[int, asyncio.Future[Mapping[str, str] | None]] = {}
        self._gone = False
        self.routed = 0  # requests routed through the owner (for this worker's own view)

    # -- the edge's calls -------------------------------------------------------------------------

    async def route(
        self,
        request: InferenceRequest,
        subset: Collection[str] | None = None,
        trace: RequestTrace | None = None,
        after: Callable[[Callable[[], object]], None] | None = None,
    ) -> RemoteRouted:
        """Route ``request`` in the owner; raises the owner's EppError when it is refused.

        ``after`` is not used: the hooks run in the owner, before its answer."""
        if self._gone:
            raise EppError(Reason.INTERNAL, "the endpoint picker's routing process is not running")
        self._next_id += 1
        request_id = self._next_id
        future: asyncio.Future[msgspec.Struct] = asyncio.get_running_loop().create_future()
        self._routes[request_id] = future
        headers = request.headers
        self.send(
            ipc.Route(
                request_id,
                request.request_id,
                request.method,
                request.path,
                headers if type(headers) is dict else dict(headers),
                request.api.value,
                request.model,
                request.prompt,
                request.stream,
                request.cache_salt,
                request.max_tokens,
                request.body_size,
                subset if subset is None or type(subset) is list else list(subset),
                _traceparent(trace) if trace is not None else None,
                request.body if self.send_body else b"",
            )
        )
        try:
            answer = await future
        except asyncio.CancelledError:
            self._routes.pop(request_id, None)
            self.send(ipc.Cancel(request_id))  # the owner stops its admission wait, or finishes the pick
            raise
        if isinstance(answer, ipc.Routed):
            self.routed += 1
            if trace is not None:
                _scheduled(trace, request, answer.priority)
            return RemoteRouted(self, request_id, request, answer)
        if isinstance(answer, ipc.Refusal):
            raise EppError(Refusal(answer.refusal), answer.message, headers=answer.headers or {})
        if isinstance(answer, ipc.Failed):
            raise RuntimeError(f"routing failed in the owner process: {answer.message}")
        raise EppError(Reason.INTERNAL, "the endpoint picker's routing process is not running")

    def claim(self, token: str) -> RemoteRouted:
        """The request another worker routed whose response this worker observes (``token``: that worker's
        :func:`~epp.requestcontrol.ipc.worker_token`): it becomes this worker's in the owner, under an
        id of this worker, and the response's events follow the claim there. Not the request itself
        (the observer reads none of it): the pick's name and destination are not known here."""
        self._next_id += 1
        self.post(ipc.Claim(token, self._next_id))
        return RemoteRouted(self, self._next_id, None, _CLAIMED)

    # -- the owner's answers ----------------------------------------------------------------------

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """The owner's messages this director handles, for the worker's :class:`~epp.requestcontrol.ipc.Channel`."""
        return {
            ipc.Routed: self._answer,
            ipc.Refusal: self._answer,
            ipc.Failed: self._answer,
            ipc.HeadersAnswer: self._headers_answer,
            ipc.Models: self._models,
        }

    def _answer(self, message: ipc.Routed | ipc.Refusal | ipc.Failed) -> None:
        future = self._routes.pop(message.id, None)
        if future is not None and not future.done():
            future.set_result(message)
        # else: the stream was cancelled and its Cancel is on the way: the owner finishes the pick

    def _headers_answer(self, message: ipc.HeadersAnswer) -> None:
        future = self._headers.pop(message.id, None)
        if future is not None and not future.done():
            future.set_result(message.added)

    def _models(self, message: ipc.Models) -> None:
        self.datastore.update(message.cards)

    def owner_lost(self) -> None:
        """The owner process went away: every route and header wait fails now, and later ones at once."""
        self._gone = True
        gone = ipc.Failed(0, "the endpoint picker's routing process stopped")
        for future in self._routes.values():
            if not future.done():
                future.set_result(gone)
        for waiting in self._headers.values():
            if not waiting.done():
                waiting.set_exception(RuntimeError("the endpoint picker's routing process stopped"))
        self._routes.clear()
        self._headers.clear()

    def _wait_headers(self, request_id: int) -> asyncio.Future[Mapping[str, str] | None]:
        future: asyncio.Future[Mapping[str, str] | None] = asyncio.get_running_loop().create_future()
        if self._gone:
            future.set_result(None)  # the stream fails soon anyway; the response goes on meanwhile
        else:
            self._headers[request_id] = future
        return future

    def _forget_headers(self, request_id: int) -> None:
        self._headers.pop(request_id, None)

    @property
    def waiting(self) -> int:
        """Routes waiting for the owner's answer."""
        return len(self._routes)


_CLAIMED = ipc.Routed(0, "", "")  # (what a claimed request's RemoteRouted knows of the pick: nothing)


class RemoteRouted:
    """A request routed by the owner, as the edge sees it: the pick, and the lifecycle calls as messages."""

    __slots__ = (
        "_director", "_ended", "_finished", "_first_byte", "_headers", "_sent", "_started", "destination", "id",
        "primary", "request", "scores", "status",
    )  # fmt: skip

    def __init__(
        self, director: RemoteDirector, request_id: int, request: InferenceRequest | None, answer: ipc.Routed
    ) -> None:
        self._director = director
        self.id = request_id  # this worker's id of the request in the owner (see RemoteDirector.route)
        self.request = request
        self.destination = answer.destination
        self.scores = answer.scores  # (--emit-endpoint-scores)
        hostport = answer.destination.partition(",")[0]
        self.primary = _Primary(answer.primary, hostport)
        self.status = 0
        self._sent = time.monotonic()
        self._first_byte = 0.0
        self._started = False
        self._finished = False
        self._ended: tuple[int, tuple[int, int] | None] | None = None
        self._headers: dict[str, str] | None = None  # response headers the owner has not had yet

    @property
    def response_bytes(self) -> int:
        return self._ended[0] if self._ended is not None else 0

    @property
    def usage(self) -> tuple[int, int] | None:
        return self._ended[1] if self._ended is not None else None

    @property
    def first_byte_after(self) -> float | None:
        return self._first_byte - self._sent if self._first_byte else None

    def response_headers(
        self, headers: Mapping[str, str]
    ) -> dict[str, str] | asyncio.Future[Mapping[str, str] | None] | None:
        """Send the response headers; a future of the headers to set when plugins' hooks decide them."""
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        director = self._director
        if self._finished:
            return None
        if director.wait_for_headers:
            future = director._wait_headers(self.id)
            director.send(ipc.Headers(self.id, dict(headers), True))
            return future
        # The owner's request reads the status, and only for a 503 whether the pod sent it (its headers).
        self._headers = dict(headers) if self.status == 503 else {":status": status}
        return None

    def response_body_started(self) -> None:
        if not self._started and not self._finished:
            self._started = True
            self._first_byte = time.monotonic()
            headers, self._headers = self._headers, None
            self._director.post(ipc.Started(self.id, headers))

    def response_ended(self, size: int, usage: tuple[int, int] | None) -> None:
        self._ended = (size, usage)

    def finish(self, outcome: Outcome = "complete") -> None:
        if self._finished:
            return
        self._finished = True
        self._director._forget_headers(self.id)
        headers, self._headers = self._headers, None
        self._director.post(ipc.Finish(self.id, outcome, self._ended, headers))


class RemoteMetrics:
    """The edge's request metrics in a worker: refusals go to the owner's registry (:class:`Refused`), and
    with ``--enable-grpc-stream-metrics`` each stream's start and end (:meth:`opened`, :meth:`closed`):
    posted, so they ride in frames that go anyway."""

    def __init__(self, post: Send = _not_connected) -> None:
        self.post = post

    def refused(self, error: EppError, model: str | None = None) -> None:
        self.post(ipc.Refused(error.refusal.value, model))

    def opened(self) -> None:
        self.post(ipc.StreamOpened())

    def closed(self, code: str, seconds: float) -> None:
        self.post(ipc.StreamClosed(code, seconds))


def _traceparent(trace: RequestTrace) -> str | None:
    """The W3C traceparent of ``trace``'s orchestration span: the owner's spans' parent (None: not recorded)."""
    span = trace._orchestration  # started by trace.parsed(); None when the sampler dropped the request
    if span is None:
        return None
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _scheduled(trace: RequestTrace, request: InferenceRequest, priority: int) -> None:
    """The orchestration span's attributes the owner's director sets in one process."""
    span = trace._orchestration
    if span is not None:
        span.set_attributes({"target_model": request.model, "request_prio": priority})
