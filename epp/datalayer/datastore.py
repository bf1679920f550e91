"""The pool: which model-server endpoints exist right now, and what each last reported.

Design
------
The datastore holds the endpoints of one InferencePool. Writers (the static ``--endpoints`` list
today; Kubernetes discovery later) replace or edit the set, and the scraper swaps in each
endpoint's latest :class:`Metrics`. Both :class:`Endpoint` and :class:`Metrics` are immutable: a
metrics update replaces the endpoint's record, never mutates it. :meth:`Datastore.endpoints`
returns an immutable tuple (rebuilt at most once per change, on the first read after it), so a
request that reads it once holds one consistent view of every endpoint and its metrics for its
whole scheduling cycle, with no lock.

In-flight accounting: scraped metrics lag the requests this picker has just sent (a scrape every
50 ms; a burst arrives in one). Each endpoint carries an :class:`InFlight` record, one mutable
object for the endpoint's whole life in the pool (carried across metrics updates and re-labels):
the director adds each request it routes there and releases it when the response ends, errors or
is cancelled. :attr:`Endpoint.queue_depth` and :attr:`Endpoint.kv_usage` are what scorers read:
the scraped numbers plus the requests (and their prompt tokens) sent after that scrape was taken,
so a burst spreads instead of herding onto the endpoint that looked idle at the last scrape.
:attr:`Endpoint.queue_ahead` refines the queue for the queue scorer: the request a pod is
prefilling counts by the share of its prefill still to do, from each pod's learned prefill time
per prompt token.

Readiness (gRPC health) follows "the pool has an endpoint". Listeners hear about membership
changes (an endpoint added, removed or re-labelled), not about metrics updates: the scraper starts
and stops its per-endpoint loops from them. Metrics listeners (:meth:`Datastore.on_metrics`) hear
about every metrics update instead: flow control re-checks saturation on each, so a queued request
leaves as soon as a scrape shows room, without polling.
"""

from __future__ import annotations

import bisect
import ipaddress
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from epp.datalayer.engines import ENGINE_TYPE_LABEL  # the pod label naming a pod's engine

__all__ = [
    "ENGINE_TYPE_LABEL",
    "Datastore",
    "Endpoint",
    "InFlight",
    "Metrics",
    "check_unique",
    "parse_endpoint",
    "parse_endpoints",
    "read_endpoints_file",
]

_EMPTY: Mapping[str, str] = MappingProxyType({})



@dataclass(frozen=True, slots=True)
class Metrics:
    """What an endpoint's model server last reported, as of ``updated_at``.

    ``stale`` is set when no scrape succeeded within ``--metrics-staleness-threshold`` (and before
    the first one): the numbers are then not to be trusted, and scorers and saturation detection
    treat the endpoint as fully loaded. ``error`` says why the last scrape failed or what it lacked
    (None when it was complete).
    """

    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int = 0
    block_size: int | None = None  # KV-cache block size, tokens
    num_gpu_blocks: int | None = None
    updated_at: float = 0.0  # time.monotonic() of the scrape these numbers come from; 0: never
    stale: bool = True
    error: str | None = None


NEVER_SCRAPED = Metrics(error="not scraped yet")

# Weight of each new sample in InFlight.seconds_per_token: about the last five clean requests, so the
# estimate follows a change of prompt mix or prefix-hit rate within a few requests while one outlier
# (a request slowed by another picker's traffic) moves it by a fifth.
_LEARNING_RATE = 0.2


def _find_pending(pending: list[list[Any]], ticket: tuple[float, int] | None) -> int | None:
    """Index of ``ticket``'s entry in ``pending`` (the oldest when None); None if absent."""
    if not pending:
        return None
    if ticket is None:
        return 0
    sent, tokens = ticket
    for index, entry in enumerate(pending):
        if entry[0] == sent and entry[1] == tokens:
            return index
    return None


class InFlight:
    """Requests this picker sent to one endpoint whose responses have not ended.

    ``requests`` and ``tokens`` (estimated prompt tokens) count all of them; :meth:`since` counts
    those sent after a given ``time.monotonic()`` instant (the last scrape's). ``unanswered``
    counts those whose response body has not started: queued at the pod or in prefill. Several scorers ask
    the same question of the same endpoint in one scheduling cycle, so the last answer is kept
    until the record changes.

    Prefill progress: the unanswered requests are kept in send order, the oldest (the *head*) being
    the one the pod is prefilling (a pod serves its queue first come, first served). Its prefill
    started when it was sent, or when the request before it was answered, whichever is later. The
    record learns the pod's prefill time per prompt token (``seconds_per_token``, a moving average)
    from the requests that found nothing unanswered ahead of them: for those, send to first body
    byte is their own prefill alone. :meth:`pending_depth` uses both to say how far along the head
    is (see there).
    """

    __slots__ = (
        "_times", "_tokens", "requests", "tokens", "unanswered", "_memo_key", "_memo",
        "_pending", "seconds_per_token",
    )  # fmt: skip

    def __init__(self) -> None:
        self._times: list[float] = []  # send times, ascending (time.monotonic() only grows)
        self._tokens: list[int] = []  # tokens of the request sent at the same index
        self.requests = 0
        self.tokens = 0
        self.unanswered = 0
        self._memo_key: float | None = None
        self._memo = (0, 0)
        # Unanswered requests in send order: [sent, tokens, prefill start or None, started clean].
        self._pending: list[list[Any]] = []
        self.seconds_per_token: float | None = None  # learned prefill time per prompt token

    def add(self, tokens: int = 0, now: float | None = None) -> tuple[float, int]:
        """Count one request; the returned ticket releases it."""
        sent = time.monotonic() if now is None else now
        times = self._times
        if times and sent < times[-1]:  # only an explicit ``now`` can go back: keep the order
            index = bisect.bisect_right(times, sent)
            times.insert(index, sent)
            self._tokens.insert(index, tokens)
        else:
            times.append(sent)
            self._tokens.append(tokens)
        self.requests += 1
        self.tokens += tokens
        self.unanswered += 1
        self._memo_key = None
        pending = self._pending
        if not pending:  # nothing ahead of it: its prefill starts now, and alone
            pending.append([sent, tokens, sent, True])
        else:
            index = len(pending)
            while index and pending[index - 1][0] > sent:  # only an explicit ``now`` can go back
                index -= 1
            pending.insert(index, [sent, tokens, None, False])
        return sent, tokens

    def answering(self, ticket: tuple[float, int] | None = None, now: float | None = None) -> None:
        """One request's response body has started (call once per request, before its release).

        ``ticket``: which one (the oldest unanswered when not given). When it is the head and
        started with nothing ahead of it, its send-to-answer time per prompt token updates
        ``seconds_per_token``; the next request's prefill starts now.
        """
        if self.unanswered > 0:
            self.unanswered -= 1
        pending = self._pending
        index = _find_pending(pending, ticket)
        if index is None:
            return
        entry = pending.pop(index)
        at = time.monotonic() if now is None else now
        if index == 0:
            sent, tokens, started, clean = entry
            if clean and tokens > 0 and at > started:
                sample = (at - started) / tokens
                previous = self.seconds_per_token
                self.seconds_per_token = sample if previous is None else previous + _LEARNING_RATE * (sample - previous)
            if pending:
                head = pending[0]
                head[2] = at if head[0] < at else head[0]

    def pending_depth(self, now: float | None = None) -> float:
        """The unanswered requests, the head counted by how much of its prefill is left.

        Each request behind the head counts 1. The head counts from 1 (its prefill just started,
        or nothing learned yet) down to 0.5 (its expected prefill time, ``seconds_per_token`` x
        its prompt tokens, has passed: it is about to answer, but has not). Never below 0.5, so a
        pod with a prefill under way always ranks behind one with none, whatever the estimate;
        between pods with the same number unanswered, the one nearer the end of its prefill ranks
        first. 0 when nothing is unanswered.

        Why 0.5 and not lower: a pod whose head is overdue (the estimate was short: a prompt with
        fewer cached tokens than usual, a slower pod) must still lose to an idle pod by more than
        the KV-cache scorer can add. Among pods that are all busy the floor does not matter: the
        queue scorer's min-max normalisation stretches their range to 0..1 anyway. (An offline
        replay of bench/routing_quality.py's workload c through the simulator's step model: TTFT
        P90 the same within 1% for learned rates 0.7x to 1.5x the true one with 0.5; with 0.05 a
        rate 0.7x the true one lost the gain.)
        """
        pending = self._pending
        if not pending:
            return 0.0
        depth = float(len(pending))
        rate = self.seconds_per_token
        sent, tokens, started, _ = pending[0]
        if rate is not None and tokens > 0:
            at = time.monotonic() if now is None else now
            done = (at - (sent if started is None else started)) / (rate * tokens)  # share of the prefill done
            if done > 0.0:
                depth -= 0.5 * (done if done < 1.0 else 1.0)
        return depth

    def release(self, ticket: tuple[float, int], *, answered: bool = True) -> None:
        """Stop counting the request ``ticket`` stands for (a second release is a no-op).

        ``answered=False``: its response body never started (error, cancellation, no body seen),
        so it still counted in ``unanswered``.
        """
        sent, tokens = ticket
        times, token_list = self._times, self._tokens
        index = bisect.bisect_left(times, sent)
        while index < len(times) and times[index] == sent:
            if token_list[index] == tokens:  # equal tickets are interchangeable
                del times[index]
                del token_list[index]
                if not answered:
                    if self.unanswered > 0:
                        self.unanswered -= 1
                    where = _find_pending(self._pending, ticket)
                    if where is not None:
                        del self._pending[where]
                        if where == 0 and self._pending and self._pending[0][2] is None:
                            head = self._pending[0]
                            now = time.monotonic()
                            head[2] = now if head[0] < now else head[0]
                self.requests -= 1
                self.tokens -= tokens
                self._memo_key = None
                return
            index += 1

    def since(self, instant: float) -> tuple[int, int]:
        """(requests, tokens) still in flight that were sent after ``instant``."""
        if instant == self._memo_key:
            return self._memo
        times = self._times
        if not times or times[-1] <= instant:
            result = (0, 0)
        else:
            first = bisect.bisect_right(times, instant)
            result = (len(times) - first, sum(self._tokens[first:]) if first else self.tokens)
        self._memo_key = instant
        self._memo = result
        return result


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One model-server endpoint (a pod's serving port).

    ``hostport`` is what Envoy's ORIGINAL_DST cluster dials: an IP literal and a port
    (``10.0.0.1:8000``, ``[fd00::1]:8000``).
    """

    name: str
    address: str
    port: int
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    # Not part of the endpoint's identity: a metrics update is not a membership change.
    metrics: Metrics = field(default=NEVER_SCRAPED, compare=False, hash=False, repr=False)
    inflight: InFlight = field(default_factory=InFlight, compare=False, hash=False, repr=False)

    @property
    def hostport(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

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
        prefill is left, between 1 and 0.5 (:meth:`InFlight.pending_depth`).

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


def parse_endpoint(text: str) -> Endpoint:
    """``ip:port`` or ``[ipv6]:port`` -> Endpoint named after it. ValueError says what is wrong."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"endpoint {text!r} is not ip:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"endpoint {text!r}: write an IPv6 address in brackets, as [address]:port")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(
            f"endpoint {text!r}: {host!r} is not an IP address (Envoy's ORIGINAL_DST cluster dials IPs, not names)"
        ) from None
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(f"endpoint {text!r}: port must be 1-65535")
    endpoint = Endpoint(name="", address=str(address), port=int(port_text))
    return Endpoint(name=endpoint.hostport, address=endpoint.address, port=endpoint.port)


def parse_endpoints(text: str) -> list[Endpoint]:
    """A comma- or whitespace-separated list of ``ip:port``; duplicates are an error."""
    return check_unique([parse_endpoint(item) for item in text.replace(",", " ").split()])


def check_unique(endpoints: list[Endpoint]) -> list[Endpoint]:
    """``endpoints`` itself; ValueError naming the first endpoint listed twice."""
    seen: set[str] = set()
    for endpoint in endpoints:
        if endpoint.hostport in seen:
            raise ValueError(f"endpoint {endpoint.hostport} is listed twice")
        seen.add(endpoint.hostport)
    return endpoints


def read_endpoints_file(path: str | Path) -> list[Endpoint]:
    """One ``ip:port`` per line, optionally followed by ``key=value`` labels; ``#`` starts a comment.

    ``10.0.0.7:8000 inference.networking.k8s.io/engine-type=sglang`` selects the SGLang metric
    names for that endpoint, as the pod label does in Kubernetes.
    """
    endpoints = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.partition("#")[0].split()
        if not words:
            continue
        labels = {}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or not key:
                raise ValueError(f"{path}:{number}: {word!r} is not a key=value label")
            labels[key] = value
        endpoint = parse_endpoint(words[0])
        endpoints.append(replace(endpoint, labels=labels) if labels else endpoint)
    return check_unique(endpoints)


Listener = Callable[[tuple[Endpoint, ...], tuple[Endpoint, ...]], None]


class Datastore:
    """The current endpoints of the pool, published as immutable snapshots."""

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._by_name: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] | None = ()
        self._by_hostport: Mapping[str, Endpoint] | None = _EMPTY
        self._listeners: list[Listener] = []
        self._metrics_listeners: list[Callable[[str], None]] = []
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

    def update_metrics(self, name: str, metrics: Metrics) -> bool:
        """Swap in ``name``'s latest metrics; False (and nothing changes) if it left the pool."""
        endpoint = self._by_name.get(name)
        if endpoint is None:
            return False
        # The constructor, not dataclasses.replace: half the cost, 2,000 times a second at 100 pods.
        self._by_name[name] = Endpoint(endpoint.name, endpoint.address, endpoint.port, endpoint.labels, metrics, endpoint.inflight)
        self._snapshot = None
        self._by_hostport = None
        for listener in self._metrics_listeners:
            listener(name)
        return True

    def _apply(self, by_name: dict[str, Endpoint]) -> None:
        old = self._by_name
        for name, endpoint in by_name.items():
            previous = old.get(name)
            if previous is not None and previous is not endpoint:
                # A re-listed or re-labelled endpoint keeps what it last reported and its in-flight count.
                metrics = previous.metrics if endpoint.metrics is NEVER_SCRAPED else endpoint.metrics
                by_name[name] = replace(endpoint, metrics=metrics, inflight=previous.inflight)
        added = tuple(e for name, e in by_name.items() if old.get(name) != e)
        removed = tuple(e for name, e in old.items() if by_name.get(name) != e)
        self._by_name = by_name
        self._snapshot = None
        self._by_hostport = None
        if added or removed:
            for listener in self._listeners:
                listener(added, removed)
