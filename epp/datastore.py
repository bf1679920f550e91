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

Readiness (gRPC health) follows "the pool has an endpoint". Listeners hear about membership
changes (an endpoint added, removed or re-labelled), not about metrics updates: the scraper starts
and stops its per-endpoint loops from them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from epp.engine_metrics import ENGINE_TYPE_LABEL  # the pod label naming a pod's engine

__all__ = [
    "ENGINE_TYPE_LABEL",
    "Datastore",
    "Endpoint",
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

    @property
    def hostport(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


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
        self._by_name[name] = replace(endpoint, metrics=metrics)
        self._snapshot = None
        self._by_hostport = None
        return True

    def _apply(self, by_name: dict[str, Endpoint]) -> None:
        old = self._by_name
        for name, endpoint in by_name.items():
            previous = old.get(name)
            if previous is not None and endpoint.metrics is NEVER_SCRAPED:
                # A re-listed or re-labelled endpoint keeps what it last reported.
                by_name[name] = replace(endpoint, metrics=previous.metrics)
        added = tuple(e for name, e in by_name.items() if old.get(name) != e)
        removed = tuple(e for name, e in old.items() if by_name.get(name) != e)
        self._by_name = by_name
        self._snapshot = None
        self._by_hostport = None
        if added or removed:
            for listener in self._listeners:
                listener(added, removed)
