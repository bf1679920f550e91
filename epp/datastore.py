"""The pool: which model-server endpoints exist right now.

Design
------
The datastore holds the endpoints of one InferencePool. Writers (the static ``--endpoints`` list
today; Kubernetes discovery later) replace or edit the set; every change publishes a new immutable
tuple, so a request that reads :meth:`Datastore.endpoints` once holds one consistent view for its
whole scheduling cycle with no lock. Readiness (gRPC health) follows "the pool has an endpoint",
and listeners hear about changes (the scraper starts and stops per-endpoint work from them).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

__all__ = ["Datastore", "Endpoint", "check_unique", "parse_endpoint", "parse_endpoints", "read_endpoints_file"]

_EMPTY: Mapping[str, str] = MappingProxyType({})


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
    """One or more ``ip:port`` per line; ``#`` starts a comment."""
    lines = Path(path).read_text().splitlines()
    return parse_endpoints(" ".join(line.partition("#")[0] for line in lines))


Listener = Callable[[tuple[Endpoint, ...], tuple[Endpoint, ...]], None]


class Datastore:
    """The current endpoints of the pool, published as immutable snapshots."""

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._by_name: dict[str, Endpoint] = {}
        self._snapshot: tuple[Endpoint, ...] = ()
        self._by_hostport: Mapping[str, Endpoint] = _EMPTY
        self._listeners: list[Listener] = []
        self.replace(endpoints)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """The current endpoints: an immutable snapshot, safe to hold for a whole request."""
        return self._snapshot

    def by_hostport(self) -> Mapping[str, Endpoint]:
        """The current endpoints keyed by ``ip:port`` (the form subset hints use)."""
        return self._by_hostport

    @property
    def ready(self) -> bool:
        return bool(self._snapshot)

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(added, removed)`` after every change."""
        self._listeners.append(listener)

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        self._apply({endpoint.name: endpoint for endpoint in endpoints})

    def upsert(self, endpoint: Endpoint) -> None:
        self._apply({**self._by_name, endpoint.name: endpoint})

    def remove(self, name: str) -> None:
        if name in self._by_name:
            self._apply({key: value for key, value in self._by_name.items() if key != name})

    def _apply(self, by_name: dict[str, Endpoint]) -> None:
        old = self._by_name
        added = tuple(e for name, e in by_name.items() if old.get(name) != e)
        removed = tuple(e for name, e in old.items() if by_name.get(name) != e)
        self._by_name = by_name
        self._snapshot = tuple(by_name.values())
        self._by_hostport = MappingProxyType({e.hostport: e for e in self._snapshot})
        if added or removed:
            for listener in self._listeners:
                listener(added, removed)
