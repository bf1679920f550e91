"""The director: from a parsed request to the endpoints to try, and the request's lifecycle after.

Design
------
:mod:`epp.extproc` speaks the protocol; the director decides. For each request it takes one
snapshot of the pool, narrows it to the gateway's subset hint, runs the scheduler and returns a
:class:`Routing` whose lifecycle calls (``response_headers``, ``finish``) the protocol module makes
as the response streams back. ``finish`` runs exactly once however the stream ends (complete,
error, cancelled), which is where in-flight accounting is released.

In-flight accounting: a routed request is added to its primary endpoint's
:class:`epp.datastore.InFlight` record (with its estimated prompt tokens) before the plugins'
``pre_request`` hooks run, and released in ``finish``; scorers see it through
``Endpoint.queue_depth``/``kv_usage`` until a scrape taken after it was sent reports the pod's own
numbers. Plugin hook failures are logged and never fail the request.

``route`` is a coroutine although today it never waits: admission and flow control will hold
requests here until the pool has capacity, without touching the protocol module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

from epp.datastore import Datastore, Endpoint
from epp.errors import EppError, Reason
from epp.metrics import Metrics
from epp.request import InferenceRequest
from epp.scheduling import Scheduler, SchedulingResult

__all__ = ["Director", "Routing"]

log = logging.getLogger(__name__)


class Routing:
    """A routed request: its pick, and the hooks called while its response streams back."""

    __slots__ = ("request", "result", "endpoints", "_director", "_ticket", "_finished", "status")

    def __init__(self, director: Director, request: InferenceRequest, result: SchedulingResult, ticket: Any) -> None:
        self.request = request
        self.result = result
        self.endpoints = result.endpoints
        self.status = 0
        self._director = director
        self._ticket = ticket
        self._finished = False

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: primary first, then fallbacks."""
        return ",".join(endpoint.hostport for endpoint in self.endpoints)

    def response_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """The response headers arrived; returns the headers plugins ask to set on the response."""
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        return self._director._response_received(self, headers)

    def finish(self, outcome: str = "complete") -> None:
        """The response ended (``complete``), failed (``error``) or the stream went away (``cancelled``)."""
        if self._finished:
            return
        self._finished = True
        if outcome == "complete" and self.status >= 500:
            outcome = "error"
        self._director._finished(self, outcome)


class Director:
    def __init__(
        self,
        datastore: Datastore,
        scheduler: Scheduler,
        metrics: Metrics,
        *,
        base_models: frozenset[str] = frozenset(),
    ) -> None:
        self.datastore = datastore
        self.scheduler = scheduler
        self.metrics = metrics
        self.base_models = base_models
        self._succeeded = metrics.scheduler_attempts.labels("success")
        self._failed = metrics.scheduler_attempts.labels("failure")

    async def route(self, request: InferenceRequest, subset: Collection[str] | None = None) -> Routing:
        """Pick the endpoints for ``request``; raises EppError(NO_ENDPOINT) when none can take it.

        ``subset``: the gateway's hint (``ip:port`` strings); when given, only those pool members
        are candidates.
        """
        started = time.perf_counter()
        candidates: tuple[Endpoint, ...] | list[Endpoint] = self.datastore.endpoints()
        if subset is not None:
            by_hostport = self.datastore.by_hostport()
            candidates = [by_hostport[hostport] for hostport in subset if hostport in by_hostport]
            if not candidates:
                self._failed.inc()
                raise EppError(
                    Reason.NO_ENDPOINT,
                    "no pool endpoint matches the gateway's subset hint"
                    + (f" ({', '.join(list(subset)[:5])})" if subset else " (the hint is empty)"),
                )
        if not candidates:
            self._failed.inc()
            raise EppError(Reason.NO_ENDPOINT, "the inference pool has no ready endpoint")
        scheduler = self.scheduler
        try:
            result = scheduler.run(request, candidates)
        except Exception:
            self._failed.inc()
            raise
        endpoints = result.endpoints
        if not endpoints:
            self._failed.inc()
            raise EppError(Reason.NO_ENDPOINT, f"no endpoint can take this request ({len(candidates)} candidates filtered out)")
        self._succeeded.inc()
        self.metrics.scheduler_e2e.observe(time.perf_counter() - started)
        # The request counts toward its primary's load from now until its response ends.
        ticket = endpoints[0].inflight.add(request.prompt_tokens)
        self.metrics.for_model(request.model).running.inc()
        routing = Routing(self, request, result, ticket)
        try:
            scheduler.pre_request(request, result)
        except Exception:
            log.exception("a pre-request plugin failed for request %s", request.request_id or "?")
        return routing

    def _response_received(self, routing: Routing, headers: Mapping[str, str]) -> dict[str, str] | None:
        try:
            return self.scheduler.response_received(routing.request, routing.endpoints[0], headers)
        except Exception:
            log.exception("a response-received plugin failed for request %s", routing.request.request_id or "?")
            return None

    def _finished(self, routing: Routing, outcome: str) -> None:
        primary = routing.endpoints[0]
        primary.inflight.release(routing._ticket)
        self.metrics.for_model(routing.request.model).running.dec()
        try:
            self.scheduler.response_complete(routing.request, primary, outcome)
        except Exception:
            log.exception("a response-complete plugin failed for request %s", routing.request.request_id or "?")
