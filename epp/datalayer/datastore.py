"""The pool: which model-server endpoints exist right now, what each last reported, and what was sent there.

Design
------
The datastore holds the endpoints of one InferencePool. Writers (the static ``--endpoints`` list,
Kubernetes discovery) replace or edit the set, and the scraper swaps in each endpoint's latest
:class:`~epp.framework.Metrics`. Both :class:`~epp.framework.Endpoint` and its metrics are immutable:
a metrics update replaces the endpoint's record, never mutates it. :meth:`Datastore.endpoints`
returns an immutable tuple (rebuilt at most once per change, on the first read after it), so a
request that reads it once holds one consistent view of every endpoint and its metrics for its
whole scheduling cycle, with no lock.

In-flight accounting (:mod:`epp.datalayer.inflight`): the datastore owns one
:class:`~epp.datalayer.inflight.InFlight` record per endpoint name, for the endpoint's whole life in
the pool (carried across metrics updates and re-labels), and attaches it to every version of the
endpoint as its read-only ``inflight`` view. The request path gets the record itself from
:meth:`Datastore.in_flight` to add and release its requests.

Readiness (gRPC health) follows "the pool has an endpoint that has answered a scrape" (the service
reads it from the endpoints' ``metrics.updated_at``). Listeners hear about membership changes
(an endpoint added, removed or re-labelled), not about metrics updates: the scraper starts and
stops its per-endpoint loops from them. Metrics listeners (:meth:`Datastore.on_metrics`) hear about
every metrics update instead: flow control re-checks saturation on each, so a queued request leaves
as soon as a scrape shows room, without polling.

Served models (:mod:`epp.datalayer.served`): the model poller swaps in each endpoint's
``/v1/models`` list (:meth:`Datastore.update_served`); :meth:`Datastore.base_models` is their union
of base models, which request parsing reads so a base-model request is never taken for an adapter
one. A 404 on the response path is reported with :meth:`Datastore.not_found`, which the poller
hears to re-read that endpoint's list soon.

Unreachable endpoints: :meth:`Datastore.mark_unreachable` (called by the response path when Envoy
answered for an endpoint with its own 503: it could not connect) makes the endpoint's metrics stale
at once, and keeps them stale through every later update until a scrape that succeeded after the
mark: a failed scrape's result, which may still say "fresh" (its last success is recent), must not
undo it, and a pod that is in fact alive is cleared by its next good scrape (50 ms).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from epp.datalayer.inflight import InFlight
from epp.framework import NEVER_SCRAPED, NOT_LISTED, Endpoint, Metrics, PoolListener, ServedModels

__all__ = ["Datastore", "Listener"]

_EMPTY: Mapping[str, Endpoint] = MappingProxyType({})

Listener = PoolListener


class Datastore:
    """The current endpoints of the pool, published as immutable snapshots."""

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._by_name: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] | None = ()
        self._by_hostport: Mapping[str, Endpoint] | None = _EMPTY
        self._listeners: list[Listener] = []
        self._metrics_listeners: list[Callable[[str], None]] = []
        self._in_flight: dict[str, InFlight] = {}
        self._base_models: frozenset[str] | None = frozenset()
        self._not_found_listeners: list[Callable[[str], None]] = []
        self._unreachable: dict[str, tuple[float, str]] = {}  # name -> (time.monotonic() of the mark, why)
        self.replace(endpoints)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """The current endpoints with their metrics: an immutable snapshot, safe to hold for a whole request."""
        snapshot = self._snapshot
        if snapshot is None:
            snapshot = self._snapshot = tuple(self._by_name.values())
        return snapshot

    def by_hostport(self) -> Mapping[str, Endpoint]:
        """The current endpoints keyed by ``ip:port`` (the form subset hints use)."""
        by_hostport = self._by_hostport
        if by_hostport is None:
            by_hostport = self._by_hostport = MappingProxyType({e.hostport: e for e in self.endpoints()})
        return by_hostport

    def get(self, name: str) -> Endpoint | None:
        return self._by_name.get(name)

    def in_flight(self, name: str) -> InFlight | None:
        """The in-flight record of the endpoint ``name`` (None when it is not in the pool): what the
        request path adds its requests to. Hold it for the request's whole life: a request sent to an
        endpoint that then leaves the pool is still released into the same record."""
        return self._in_flight.get(name)

    @property
    def ready(self) -> bool:
        return bool(self._by_name)

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(added, removed)`` after every membership change."""
        self._listeners.append(listener)

    def on_metrics(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` after every metrics update of an endpoint in the pool.

        It runs inside :meth:`update_metrics`, on the scraper's path: keep it cheap and non-raising.
        """
        self._metrics_listeners.append(listener)

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        self._apply({endpoint.name: endpoint for endpoint in endpoints})

    def upsert(self, endpoint: Endpoint) -> None:
        self._apply({**self._by_name, endpoint.name: endpoint})

    def remove(self, name: str) -> None:
        if name in self._by_name:
            self._apply({key: value for key, value in self._by_name.items() if key != name})

    def mark_unreachable(self, name: str, why: str) -> bool:
        """``name`` could not be reached: stale now and until a scrape succeeds after this call.

        False (and nothing changes) if it is not in the pool."""
        endpoint = self._by_name.get(name)
        if endpoint is None:
            return False
        self._unreachable[name] = (time.monotonic(), why)
        self.update_metrics(name, endpoint.metrics)
        return True

    def update_metrics(self, name: str, metrics: Metrics) -> bool:
        """Swap in ``name``'s latest metrics; False (and nothing changes) if it left the pool."""
        endpoint = self._by_name.get(name)
        if endpoint is None:
            return False
        mark = self._unreachable.get(name)
        if mark is not None:
            if metrics.updated_at > mark[0]:  # scraped successfully since: reachable again
                del self._unreachable[name]
            else:
                metrics = replace(metrics, stale=True, error=mark[1])
        # The constructor, not dataclasses.replace: half the cost, 2,000 times a second at 100 pods.
        self._by_name[name] = Endpoint(
            endpoint.name, endpoint.address, endpoint.port, endpoint.labels, metrics, endpoint.inflight, endpoint.served
        )
        self._snapshot = None
        self._by_hostport = None
        for listener in self._metrics_listeners:
            listener(name)
        return True

    def update_served(self, name: str, served: ServedModels) -> bool:
        """Swap in the models ``name`` lists at ``/v1/models``; False if it left the pool."""
        endpoint = self._by_name.get(name)
        if endpoint is None:
            return False
        self._by_name[name] = replace(endpoint, served=served)
        self._snapshot = None
        self._by_hostport = None
        self._base_models = None
        return True

    def base_models(self) -> frozenset[str]:
        """Every base model (listed without a parent) of the pool's endpoints: a request for one is
        not an adapter request. Rebuilt at most once per change of a list or of the membership."""
        bases = self._base_models
        if bases is None:
            bases = self._base_models = frozenset().union(*(e.served.base_models for e in self._by_name.values()))
        return bases

    def on_not_found(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` when a request routed to ``name`` got 404 (the model poller re-reads its list)."""
        self._not_found_listeners.append(listener)

    def not_found(self, name: str) -> None:
        """A response from ``name`` was 404: its model list may be out of date (on the response path: cheap)."""
        for listener in self._not_found_listeners:
            listener(name)

    def _apply(self, by_name: dict[str, Endpoint]) -> None:
        old = self._by_name
        records: dict[str, InFlight] = {}
        for name, endpoint in by_name.items():
            previous = old.get(name)
            record = self._in_flight.get(name) if previous is not None else None
            if record is None:
                given = endpoint.inflight
                record = given if isinstance(given, InFlight) else InFlight()
            records[name] = record
            if previous is not None and previous is not endpoint:
                # A re-listed or re-labelled endpoint keeps what it last reported and its in-flight count.
                metrics = previous.metrics if endpoint.metrics is NEVER_SCRAPED else endpoint.metrics
                served = previous.served if endpoint.served is NOT_LISTED else endpoint.served
                by_name[name] = replace(endpoint, metrics=metrics, inflight=record, served=served)
            elif endpoint.inflight is not record:
                by_name[name] = replace(endpoint, inflight=record)
        added = tuple(e for name, e in by_name.items() if old.get(name) != e)
        removed = tuple(e for name, e in old.items() if by_name.get(name) != e)
        self._by_name = by_name
        self._in_flight = records
        self._base_models = None
        for name in [name for name in self._unreachable if name not in by_name]:
            del self._unreachable[name]
        self._snapshot = None
        self._by_hostport = None
        if added or removed:
            for listener in self._listeners:
                listener(added, removed)
