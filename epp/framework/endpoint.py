"""What a plugin sees of a model-server endpoint: its identity, what it last reported, and what this
picker has sent there.

Design
------
:class:`Endpoint` and :class:`Metrics` are immutable: the data layer replaces an endpoint's record
when a scrape arrives, never mutates it, so a plugin that holds a candidate list holds one consistent
view for the whole scheduling cycle.

What an endpoint has been sent but not yet answered (*in-flight accounting*) changes between scrapes,
request by request. Plugins read it through :class:`InFlightView`, the read-only half of the record
the data layer keeps per endpoint (only the request path adds and releases requests). The derived
loads plugins should read, :attr:`Endpoint.queue_depth`, :attr:`Endpoint.queue_ahead` and
:attr:`Endpoint.kv_usage`, combine the two: the scraped numbers plus what was sent after that scrape
was taken, so that a burst spreads instead of herding onto the pod that looked idle at the last
scrape.

For tests, ``Endpoint("a", "10.0.0.1", 8000)`` is a complete endpoint: never scraped (stale), nothing
in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from epp.framework.served import NOT_LISTED, ServedModels

__all__ = ["NEVER_SCRAPED", "NO_IN_FLIGHT", "Endpoint", "InFlightView", "Metrics"]


@dataclass(frozen=True, slots=True)
class Metrics:
    """What an endpoint's model server last reported, as of ``updated_at``.

    ``stale`` is set when no scrape succeeded within ``--metrics-staleness-threshold`` (and before the
    first one): the numbers are then not to be trusted, and scorers should treat the endpoint as fully
    loaded. ``error`` says why the last scrape failed or what it lacked (None when it was complete).

    Attributes:
        waiting_queue_size: requests waiting at the pod (not yet running).
        running_requests: requests the pod is running (prefill or decode).
        kv_cache_usage: share of the KV-cache in use, 0..1.
        running_adapters, waiting_adapters: LoRA adapters the pod runs / has requests waiting for.
        max_adapters: adapter slots (0: unknown, or LoRA off).
        block_size: KV-cache block size in tokens (None: not reported).
        num_gpu_blocks: KV-cache blocks (None: not reported).
        updated_at: ``time.monotonic()`` of the scrape these numbers come from; 0: never scraped.
        kv_cache_size_tokens: the KV cache's capacity in tokens when the engine reports it (vLLM's
            ``cache_config_info`` label); None: use :attr:`cache_tokens`' fallback.
    """

    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int = 0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    updated_at: float = 0.0
    stale: bool = True
    error: str | None = None
    kv_cache_size_tokens: int | None = None

    @property
    def cache_tokens(self) -> int | None:
        """The pod's KV-cache capacity in tokens: ``kv_cache_size_tokens`` when reported, else
        ``num_gpu_blocks x block_size``; None when neither is known."""
        if self.kv_cache_size_tokens:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks and self.block_size:
            return self.num_gpu_blocks * self.block_size
        return None


NEVER_SCRAPED = Metrics(error="not scraped yet")


class InFlightView(Protocol):
    """The requests this picker sent to one endpoint whose responses have not ended (read-only)."""

    @property
    def requests(self) -> int:
        """Requests sent and not yet ended."""
        ...

    @property
    def tokens(self) -> int:
        """Their estimated prompt tokens."""
        ...

    @property
    def unanswered(self) -> int:
        """Those whose response has not started yet: queued at the pod or in prefill."""
        ...

    @property
    def seconds_per_token(self) -> float | None:
        """The pod's prefill time per prompt token, learned from this picker's requests (None: not yet)."""
        ...

    def since(self, instant: float) -> tuple[int, int]:
        """(requests, tokens) still in flight that were sent after ``instant`` (``time.monotonic()``)."""
        ...

    def pending_depth(self, now: float | None = None) -> float:
        """The unanswered requests, the one in prefill counted between 1 and 0.5 by how much of its
        prefill is left (0 when none is unanswered)."""
        ...


class _NothingInFlight:
    """The in-flight record of an endpoint no request path tracks (tests, tools)."""

    __slots__ = ()
    requests = 0
    tokens = 0
    unanswered = 0
    seconds_per_token = None

    def since(self, instant: float) -> tuple[int, int]:
        return (0, 0)

    def pending_depth(self, now: float | None = None) -> float:
        return 0.0

    def __repr__(self) -> str:
        return "NO_IN_FLIGHT"


NO_IN_FLIGHT: InFlightView = _NothingInFlight()

_NO_LABELS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint (a pod's serving port), as of one moment.

    ``hostport`` is what Envoy's ORIGINAL_DST cluster dials: an IP literal and a port
    (``10.0.0.1:8000``, ``[fd00::1]:8000``). ``labels`` are the pod's labels. ``metrics`` and
    ``inflight`` are not part of the endpoint's identity (equality and hash): a metrics update is not a
    membership change. ``kv_events_port`` and ``kv_replay_port`` (0: not given) are where, on the
    same address, the pod's server publishes its KV-cache events and answers replays (vLLM's
    ``--kv-events-config`` ``endpoint``/``replay_endpoint``), as the pool names them: the pod's
    container ports named ``kv-events``/``kv-replay`` (llm-d's names), or ``kv-events=``/
    ``kv-replay=`` in a static endpoints file.
    """

    name: str
    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=lambda: _NO_LABELS, hash=False)
    metrics: Metrics = field(default=NEVER_SCRAPED, compare=False, hash=False, repr=False)
    inflight: InFlightView = field(default=NO_IN_FLIGHT, compare=False, hash=False, repr=False)
    served: ServedModels = field(default=NOT_LISTED, compare=False, hash=False, repr=False)
    kv_events_port: int = field(default=0, hash=False)
    kv_replay_port: int = field(default=0, hash=False)

    @property
    def hostport(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    def serves(self, model: str) -> bool:
        """Whether the endpoint is known to serve ``model``: listed at ``/v1/models``, or an adapter its
        metrics page reports running or waiting (the second source, between polls)."""
        metrics = self.metrics
        return self.served.lists(model) or model in metrics.running_adapters or model in metrics.waiting_adapters

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the pod: the larger of two views.

        * the scraped waiting queue plus the requests sent since that scrape (the picker cannot know
          the pod has started them: counting them is what stops a burst herding);
        * the requests this picker sent whose response has not started yet: waiting at the pod or
          in prefill. A pod busy prefilling a long prompt reports an empty waiting queue, yet a
          new request there waits behind that prefill; this view sees it (with streamed
          responses; a non-streamed response starts at its end, so there it counts the request
          until it is done).
        """
        scraped = self._scraped_queue()
        unanswered = self.inflight.unanswered
        return scraped if scraped >= unanswered else unanswered

    def _scraped_queue(self) -> int:
        """The scraped waiting queue plus the requests this picker sent after that scrape."""
        metrics = self.metrics
        return metrics.waiting_queue_size + self.inflight.since(metrics.updated_at)[0]

    @property
    def queue_ahead(self) -> float:
        """:attr:`queue_depth`, with the request the pod is prefilling counted by how much of its
        prefill is left, between 1 and 0.5 (:meth:`InFlightView.pending_depth`).

        Among pods all busy prefilling one prompt, whole counts tie, yet a new request waits least
        on the pod whose prefill is about to end. Never more than :attr:`queue_depth`, never less
        by 0.5 or more: pods with different whole counts keep their order, and a pod with nothing
        unanswered still comes before any with a prefill under way.
        """
        scraped = self._scraped_queue()
        inflight = self.inflight
        unanswered = inflight.pending_depth() if inflight.unanswered else 0.0
        return scraped if scraped >= unanswered else unanswered

    @property
    def kv_usage(self) -> float:
        """KV-cache usage (0..1) as last scraped, plus the prompt tokens sent since, when the pod's
        cache size is known (``vllm:cache_config_info``); never above 1."""
        metrics = self.metrics
        usage = metrics.kv_cache_usage
        if metrics.num_gpu_blocks and metrics.block_size:
            tokens = self.inflight.since(metrics.updated_at)[1]
            if tokens:
                usage = min(1.0, usage + tokens / (metrics.num_gpu_blocks * metrics.block_size))
        return usage
