"""The director: from a parsed request to the endpoints to try, and the request's lifecycle after.

Design
------
:mod:`epp.extproc` speaks the protocol; the director decides. For each request it takes one
snapshot of the pool, narrows it to the gateway's subset hint, runs the scheduler and returns a
:class:`Routing` whose lifecycle calls (``response_headers``, ``finish``) the protocol module makes
as the response streams back. ``finish`` runs exactly once however the stream ends (complete,
error, cancelled), which is where in-flight accounting is released.

``route`` is a coroutine although today it never waits: admission and flow control will hold
requests here until the pool has capacity, without touching the protocol module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping

from epp.datastore import Datastore, Endpoint
from epp.errors import EppError, Reason
from epp.metrics import Metrics
from epp.request import InferenceRequest
from epp.scheduling import Scheduler

__all__ = ["Director", "Routing"]

log = logging.getLogger(__name__)


class Routing:
    """A routed request: its pick, and the hooks called while its response streams back."""

    __slots__ = ("request", "endpoints", "_director", "_finished", "status")

    def __init__(self, director: Director, request: InferenceRequest, endpoints: list[Endpoint]) -> None:
        self.request = request
        self.endpoints = endpoints
        self.status = 0
        self._director = director
        self._finished = False

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: primary first, then fallbacks."""
        return ",".join(endpoint.hostport for endpoint in self.endpoints)

    def response_headers(self, headers: Mapping[str, str]) -> None:
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0

    def finish(self, outcome: str = "complete") -> None:
        """The response ended (``complete``), failed (``error``) or the stream went away (``cancelled``)."""
        if self._finished:
            return
        self._finished = True
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
                raise EppError(
                    Reason.NO_ENDPOINT,
                    "no pool endpoint matches the gateway's subset hint"
                    + (f" ({', '.join(list(subset)[:5])})" if subset else " (the hint is empty)"),
                )
        if not candidates:
            raise EppError(Reason.NO_ENDPOINT, "the inference pool has no ready endpoint")
        endpoints = self.scheduler.schedule(request, candidates)
        if not endpoints:
            raise EppError(Reason.NO_ENDPOINT, f"no endpoint can take this request ({len(candidates)} candidates filtered out)")
        self.metrics.scheduler_e2e.observe(time.perf_counter() - started)
        self.metrics.for_model(request.model).running.inc()
        return Routing(self, request, endpoints)

    def _finished(self, routing: Routing, outcome: str) -> None:
        self.metrics.for_model(routing.request.model).running.dec()
