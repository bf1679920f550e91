"""The owner's side of a worker's channel: routes what the worker parsed, and follows each pick to its end.

Design
------
One :class:`WorkerRequests` per ext_proc worker process (:mod:`epp.server.workers`), over its
:class:`~epp.requestcontrol.ipc.Channel`. It is the other half of
:class:`~epp.requestcontrol.remote.RemoteDirector`: a :class:`~epp.requestcontrol.ipc.Route` becomes
the same :class:`~epp.framework.InferenceRequest` the edge would have built in one process (its
``adapter`` set from this process's view of the pool's base models) and goes through the one
:class:`~epp.requestcontrol.director.Director` every worker shares, so admission, flow control, the
scheduler, the prefix index and in-flight accounting see every request of every worker. Its
:class:`~epp.requestcontrol.lifecycle.RoutedRequest` stays here, keyed by the worker's id, and the
worker's events call its methods: ``response_headers`` (answered with the hooks' headers only when
the worker waits for them; else the headers come with the next event), ``response_body_started``,
and ``response_ended`` + ``finish`` (one :class:`~epp.requestcontrol.ipc.Finish`).

A route runs at once, in the read of its message: the director's coroutine is stepped by hand
(:mod:`epp.requestcontrol.stepping`, as one process does with its own routes), and when admission
lets it through (flow control off, or nothing queued) it finishes in that step, with no task, and
its answer leaves in the frame written at the end of the turn; the pick's ``pre_request`` hooks run
once that frame is written (:meth:`~epp.requestcontrol.ipc.Channel.after_flush`: the worker waits
for the answer, not for them; the next pick still runs after them, as in one process:
:mod:`epp.requestcontrol.director`). Only a route that waits in admission continues in a task; a
:class:`~epp.requestcontrol.ipc.Cancel` cancels that task (the request leaves the queue), or
finishes the pick ``cancelled`` if it was already routed. When the worker dies (:meth:`WorkerRequests.lost`) its
waiting routes are cancelled and every pick it held is finished as ``error``: in-flight accounting
and the running-requests gauge are released, nothing leaks.

Observed responses (``epp envoy-config --observe-responses``): Envoy sends a request's response on a
second stream, on a connection of its own, which the owner may have handed to another worker than
the one that routed the request. The routing worker's token names it (its prefix, kept in
``siblings`` by the pool, and the request's id there: :func:`~epp.requestcontrol.ipc.worker_token`);
the observing worker sends a :class:`~epp.requestcontrol.ipc.Claim` with an id of its own, and its
response events after it. The owner moves the request to the observing worker's table under that id
(whose events then finish it, and whose death finishes it as ``error``) and tells the routing worker
(:class:`~epp.requestcontrol.ipc.Claimed`), which lets its stream go. Two posted messages a request,
riding in frames that go anyway. A claim that names no request (routed before a restart of its
worker, or finished already: its observer came after the routing worker's 10 s wait) is logged once
a minute, and the claiming worker's events for it are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

import msgspec

from epp.errors import EppError, Refusal
from epp.framework import Api, InferenceRequest, LogLimiter
from epp.requestcontrol import ipc
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import StreamMetrics
from epp.requestcontrol.stepping import start
from epp.requestcontrol.tracing import RequestTrace, Tracing

__all__ = ["WorkerRequests", "continued_trace"]

log = logging.getLogger(__name__)

_APIS = {api.value: api for api in Api}


class WorkerRequests:
    """The requests of one worker process, routed by ``director``; ``send`` answers the worker."""

    def __init__(
        self,
        director: Director,
        send: Callable[[msgspec.Struct], None],
        *,
        tracing: Tracing | None = None,
        streams: StreamMetrics | None = None,
        siblings: Mapping[str, WorkerRequests] | None = None,
    ) -> None:
        self._director = director
        self.send = send
        self.post = send  # messages nobody waits for (the channel's post)
        # Where the pick's pre_request hooks go once its answer is sent (the channel's after_flush: they
        # run after the frame that carries it is written); by default, at once.
        self.after_sent: Callable[[Callable[[], object]], None] = _now
        self._tracing = tracing
        self._streams = streams  # --enable-grpc-stream-metrics: the worker's streams, counted here
        self._open_streams = 0
        self._routing: dict[int, asyncio.Task[None]] = {}
        self._routed: dict[int, RoutedRequest] = {}
        # The workers by their tokens' prefix (observed responses: see the module docstring), this one's
        # among them; kept by the pool.
        self._siblings: Mapping[str, WorkerRequests] = {} if siblings is None else siblings
        self.requests = 0  # routes received from this worker
        self.claimed = 0  # requests this worker routed whose response another worker observed

    @property
    def in_flight(self) -> int:
        """Requests of this worker routing (in admission) or routed and not finished."""
        return len(self._routing) + len(self._routed)

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """The worker's messages, for the owner's end of its :class:`~epp.requestcontrol.ipc.Channel`."""
        return {
            ipc.Route: self._route,
            ipc.Cancel: self._cancel,
            ipc.Headers: self._headers,
            ipc.Started: self._started,
            ipc.Finish: self._finish,
            ipc.Refused: self._refused,
            ipc.StreamOpened: self._stream_opened,
            ipc.StreamClosed: self._stream_closed,
            ipc.Claim: self._claim,
        }

    def _stream_opened(self, message: ipc.StreamOpened) -> None:
        if self._streams is not None:
            self._open_streams += 1
            self._streams.opened()

    def _stream_closed(self, message: ipc.StreamClosed) -> None:
        if self._streams is not None and self._open_streams:
            self._open_streams -= 1
            self._streams.closed(message.code, message.seconds)

    # -- routing ----------------------------------------------------------------------------------

    def _route(self, message: ipc.Route) -> None:
        self.requests += 1
        director = self._director
        model = message.model
        request = InferenceRequest(
            message.request_id,
            message.method,
            message.path,
            message.headers,
            _APIS.get(message.api, Api.OTHER),
            model=model,
            # As the edge's parser does, with this process's view of the pool's base models.
            adapter=None if not model or model in director.base_models else model,
            prompt=message.prompt,
            stream=message.stream,
            cache_salt=message.cache_salt,
            max_tokens=message.max_tokens,
            body_size=message.body_size,
            body=message.body,
        )
        trace = None
        if message.traceparent is not None and self._tracing is not None:
            trace = continued_trace(self._tracing, message.traceparent)
        # Step the route by hand: it usually ends in this first step (see the module docstring).
        task = start(self._run(message.id, request, message.subset, trace))
        if task is not None:
            self._routing[message.id] = task

    async def _run(
        self, request_id: int, request: InferenceRequest, subset: Collection[str] | None, trace: RequestTrace | None
    ) -> None:
        hooks: list[Callable[[], object]] = []
        try:
            routed = await self._director.route(request, subset, trace, after=hooks.append)
        except asyncio.CancelledError:
            return  # the worker cancelled it (nothing to answer), or the worker is gone
        except EppError as error:
            self.send(ipc.Refusal(request_id, error.refusal.value, error.message, dict(error.headers) or None))
            return
        except Exception as error:
            log.exception("routing request %s of a worker failed", request.request_id or "?")
            self.send(ipc.Failed(request_id, f"{type(error).__name__}: {error}"))
            return
        finally:
            self._routing.pop(request_id, None)
        self._routed[request_id] = routed
        self.send(
            ipc.Routed(request_id, routed.destination, routed.primary.name, routed.request.priority, routed.scores)
        )
        for work in hooks:  # (the worker waits for the answer, not for them: epp.requestcontrol.director)
            self.after_sent(work)

    def _cancel(self, message: ipc.Cancel) -> None:
        task = self._routing.pop(message.id, None)
        if task is not None:
            task.cancel()  # an admission wait: the request leaves the queue
            return
        routed = self._routed.pop(message.id, None)
        if routed is not None:  # routed, and the answer crossed the cancel
            routed.finish("cancelled")

    # -- the response -----------------------------------------------------------------------------

    def _headers(self, message: ipc.Headers) -> None:
        routed = self._routed.get(message.id)
        added = routed.response_headers(message.headers) if routed is not None else None
        if message.wait:
            self.send(ipc.HeadersAnswer(message.id, dict(added) if added else None))

    def _started(self, message: ipc.Started) -> None:
        routed = self._routed.get(message.id)
        if routed is not None:
            if message.headers is not None:
                routed.response_headers(message.headers)
            routed.response_body_started()

    def _finish(self, message: ipc.Finish) -> None:
        routed = self._routed.pop(message.id, None)
        if routed is None:
            return
        if message.headers is not None:
            routed.response_headers(message.headers)
        if message.ended is not None:
            size, usage = message.ended
            routed.response_ended(size, usage)
        outcome = message.outcome
        routed.finish(outcome if outcome in ("complete", "error", "cancelled") else "error")  # type: ignore[arg-type]

    def _claim(self, message: ipc.Claim) -> None:
        """This worker observes the response of a request another worker routed: it becomes this one's."""
        token = message.token
        routing = self._siblings.get(token[: ipc.TOKEN_PREFIX])
        try:
            request_id = int(token[ipc.TOKEN_PREFIX :], 16)
        except ValueError:
            request_id = -1
        routed = routing._routed.pop(request_id, None) if routing is not None and routing is not self else None
        if routing is None or routed is None:
            _unclaimed(token)
            return
        self._routed[message.id] = routed
        routing.claimed += 1
        routing.post(ipc.Claimed(request_id))

    def _refused(self, message: ipc.Refused) -> None:
        try:
            refusal = Refusal(message.refusal)
        except ValueError:
            refusal = Refusal.INTERNAL
        self._director.metrics.refused(EppError(refusal, ""), message.model)

    # -- the worker went away ---------------------------------------------------------------------

    def lost(self) -> None:
        """The worker process is gone: cancel its routes, finish its picks as errors (see the module docstring)."""
        routing, self._routing = self._routing, {}
        for task in routing.values():
            task.cancel()
        routed, self._routed = self._routed, {}
        for request in routed.values():
            request.finish("error")
        if self._streams is not None:  # its open streams went with it (their connections closed)
            self._streams.lost(self._open_streams)
            self._open_streams = 0


_unclaimed_limit = LogLimiter(60.0)


def _unclaimed(token: str) -> None:
    """A worker claimed a request that no other worker holds: say so, once a minute at most."""
    held = _unclaimed_limit.allow()
    if held is not None:
        log.warning(
            "a worker observes a response (token %r) whose request no other worker holds: routed before its "
            "worker restarted, or finished already; its response is not accounted (logged once a minute%s)",
            token,
            f"; {held} more since the last" if held else "",
        )


def continued_trace(tracing: Tracing, traceparent: str) -> RequestTrace | None:
    """The owner's part of a worker's request trace: admission and scheduling spans under ``traceparent``
    (the worker's orchestration span); None if it is not a W3C traceparent."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    try:
        _, trace_id, span_id, flags = traceparent.split("-")
        flags_ = TraceFlags(int(flags, 16))
        context = SpanContext(int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=flags_)
    except ValueError:
        return None
    return _ContinuedTrace(tracing, NonRecordingSpan(context))


class _ContinuedTrace(RequestTrace):
    """A :class:`RequestTrace` whose orchestration span lives in the worker: only the director's spans are made here."""

    __slots__ = ()

    def __init__(self, tracing: Tracing, parent: Any) -> None:  # not super().__init__: no root span here
        self._tracing = tracing
        self._root = parent
        self.recording = True  # the worker sends a context only for a recorded request
        self.headers = {}
        self._parse_started = 0
        self._orchestration = parent
        self._admitted = False
        self._picked_at = 0
        self._ended = False


def _now(work: Callable[[], object]) -> None:
    work()
