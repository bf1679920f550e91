"""A static pool: endpoints given on the command line (``--endpoints``) or in a file (``--endpoints-file``).

An endpoint is ``ip:port`` or ``[ipv6]:port`` (Envoy's ORIGINAL_DST cluster dials IP literals, not
names) and is named after it. A file has one endpoint per line, optionally followed by ``key=value``
pod labels; ``#`` starts a comment. Two keys are not labels: ``kv-events=PORT`` and ``kv-replay=PORT``
name the ports where that endpoint's server publishes its KV-cache events and answers replays
(vLLM's ``--kv-events-config`` ``"endpoint": "tcp://*:PORT"`` and ``"replay_endpoint"``), on the
endpoint's own address: the precise prefix-cache producer follows them there, so a pod's events
are the pod's by the pool's word, never by their topic alone (the names of llm-d's container ports,
which Kubernetes discovery reads: :mod:`epp.kube.pods`). ``kv-replay`` may come alone: a picker
that binds its KV-event socket (pods connect to it) still dials the pod's replay socket.
"""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path

from epp.framework import Endpoint

__all__ = ["KV_EVENTS_KEY", "KV_REPLAY_KEY", "check_unique", "parse_endpoint", "parse_endpoints", "read_endpoints_file"]

KV_EVENTS_KEY = "kv-events"
KV_REPLAY_KEY = "kv-replay"


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
    names for that endpoint, as the pod label does in Kubernetes; ``10.0.0.7:8000 kv-events=5557``
    says where its KV-cache events are published (see the module docstring).
    """
    endpoints = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.partition("#")[0].split()
        if not words:
            continue
        labels = {}
        ports = {KV_EVENTS_KEY: 0, KV_REPLAY_KEY: 0}
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or not key:
                raise ValueError(f"{path}:{number}: {word!r} is not a key=value label")
            if key in ports:
                if not (value.isascii() and value.isdigit()) or not 0 < int(value) < 65536:
                    raise ValueError(f"{path}:{number}: {key}={value!r}: the port must be 1-65535")
                ports[key] = int(value)
            else:
                labels[key] = value
        endpoint = parse_endpoint(words[0])
        if labels or ports[KV_EVENTS_KEY] or ports[KV_REPLAY_KEY]:
            endpoint = replace(endpoint, labels=labels or endpoint.labels, kv_events_port=ports[KV_EVENTS_KEY],
                               kv_replay_port=ports[KV_REPLAY_KEY])
        endpoints.append(endpoint)
    return check_unique(endpoints)
