"""From Kubernetes objects to pool endpoints: pure functions, no I/O.

An InferencePool (``inference.networking.k8s.io/v1``) names its members by ``spec.selector.matchLabels``
and its serving ports by ``spec.targetPorts[i].number``. Every Pod the selector matches yields one
:class:`~epp.datalayer.datastore.Endpoint` per target port, named ``<pod>-rank-<i>`` (``i`` is the port's
index in ``targetPorts``, as the upstream picker names them), when the Pod

* is Ready (its ``Ready`` condition is ``"True"``, which the kubelet holds at False until every
  container and readiness gate passes),
* is not terminating (no ``metadata.deletionTimestamp``: a pod in graceful shutdown gets no new
  requests, although it still finishes the ones it has), and
* has a pod IP (Envoy's ORIGINAL_DST cluster dials an IP literal).

The annotation ``llm-d.ai/active-ports`` (or upstream's earlier ``inference.networking.k8s.io/active-ports``),
a comma-separated list of port numbers, narrows the ports a Pod serves on: only target ports listed
there become endpoints (numbers that are not target ports, or not numbers, are ignored, as upstream
does). Pod labels go on the endpoint; the scraper picks a pod's metric names by its
``inference.networking.k8s.io/engine-type`` label.

KV-cache events: a container port named ``kv-events`` (and ``kv-replay``), the names llm-d's guides
give the port vLLM's ``--kv-events-config`` binds (``tcp://*:5557``), sets the endpoint's
``kv_events_port`` (``kv_replay_port``); the endpoint of target port ``i`` of a pod with several gets
that port + ``i``, as vLLM's data-parallel rank ``i`` publishes on the port + ``i``. The precise
prefix-cache producer connects there, so a pod's events are attributed by the pool, not by a topic.
``kv-replay`` alone is meaningful too: a picker that binds (pods connect to it) still dials the
pod's replay socket, which vLLM binds either way.

The upstream no-CRD mode (``--endpoint-selector app=vllm,env=prod --endpoint-target-ports 8000``)
builds the same :class:`PoolSpec` from flags instead of from an InferencePool.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from epp.framework import Endpoint

__all__ = [
    "ACTIVE_PORTS_ANNOTATIONS",
    "KV_EVENTS_PORT_NAME",
    "KV_REPLAY_PORT_NAME",
    "PoolSpec",
    "PoolSpecError",
    "active_ports",
    "endpoints_for",
    "format_selector",
    "named_port",
    "parse_selector",
    "parse_target_ports",
    "pod_endpoints",
    "pod_is_ready",
    "pool_spec",
]

log = logging.getLogger(__name__)

# The annotation llm-d reads first, then the key GIE used before (both are honoured upstream).
ACTIVE_PORTS_ANNOTATIONS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
# llm-d's names for the container ports of vLLM's KV-event publisher and its replay socket.
KV_EVENTS_PORT_NAME = "kv-events"
KV_REPLAY_PORT_NAME = "kv-replay"

# Kubernetes label syntax: an optional DNS-subdomain prefix and "/", then a name of at most 63
# characters; values are at most 63 characters, possibly empty (apimachinery's validation rules).
_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^{_LABEL_NAME}?$")
# InferencePool v1 allows at most 8 target ports (the CRD's maxItems).
MAX_TARGET_PORTS = 8


class PoolSpecError(ValueError):
    """An InferencePool (or the no-CRD flags) that cannot be turned into a pool; says what is wrong."""


@dataclass(frozen=True)
class PoolSpec:
    """What discovery needs from a pool: which Pods (an equality label selector) and which ports."""

    selector: tuple[tuple[str, str], ...]  # sorted (key, value) pairs; all must match
    target_ports: tuple[int, ...]  # in targetPorts order: the index is the endpoint's rank

    @property
    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` query parameter (``k1=v1,k2=v2``)."""
        return format_selector(self.selector)


def _check_label(key: str, value: str, where: str) -> None:
    if not _LABEL_KEY.match(key) or len(key) > 317:
        raise PoolSpecError(f"{where}: {key!r} is not a valid label key")
    if not _LABEL_VALUE.match(value):
        raise PoolSpecError(f"{where}: {value!r} (label {key}) is not a valid label value")


def _check_ports(ports: list[int], where: str) -> tuple[int, ...]:
    if not ports:
        raise PoolSpecError(f"{where}: at least one target port is needed")
    if len(ports) > MAX_TARGET_PORTS:
        raise PoolSpecError(f"{where}: at most {MAX_TARGET_PORTS} target ports, got {len(ports)}")
    for port in ports:
        if not 0 < port < 65536:
            raise PoolSpecError(f"{where}: port {port} is not in 1-65535")
    if len(set(ports)) != len(ports):
        raise PoolSpecError(f"{where}: port numbers must be unique, got {ports}")
    return tuple(ports)


def parse_selector(text: str) -> tuple[tuple[str, str], ...]:
    """``--endpoint-selector``: ``k=v`` pairs separated by commas (``==`` also accepted), at least one."""
    pairs: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.replace("==", "=", 1).partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key.endswith("!"):
            raise PoolSpecError(
                f"--endpoint-selector: {item!r} is not key=value (only equality selectors are supported)"
            )
        _check_label(key, value, "--endpoint-selector")
        if key in pairs and pairs[key] != value:
            raise PoolSpecError(f"--endpoint-selector: label {key} is given twice")
        pairs[key] = value
    if not pairs:
        raise PoolSpecError("--endpoint-selector: no key=value pair given")
    return tuple(sorted(pairs.items()))


def parse_target_ports(text: str) -> tuple[int, ...]:
    """``--endpoint-target-ports``: comma-separated port numbers, unique, 1 to 8 of them."""
    ports = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if not (item.isascii() and item.isdigit()):
            raise PoolSpecError(f"--endpoint-target-ports: {item!r} is not a port number")
        ports.append(int(item))
    return _check_ports(ports, "--endpoint-target-ports")


def format_selector(selector: Iterable[tuple[str, str]]) -> str:
    return ",".join(f"{key}={value}" for key, value in selector)


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """The :class:`PoolSpec` of an InferencePool v1 object (a decoded JSON dict); PoolSpecError if malformed."""
    name = f"InferencePool {pool.get('metadata', {}).get('name', '?')}"
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise PoolSpecError(f"{name}: no spec")
    selector = spec.get("selector")
    match_labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(match_labels, Mapping) or not match_labels:
        raise PoolSpecError(f"{name}: spec.selector.matchLabels is missing or empty (is this InferencePool v1?)")
    for key, value in match_labels.items():
        if not isinstance(value, str):
            raise PoolSpecError(f"{name}: spec.selector.matchLabels[{key}] is not a string")
        _check_label(str(key), value, name)
    target_ports = spec.get("targetPorts")
    if not isinstance(target_ports, list):
        raise PoolSpecError(f"{name}: spec.targetPorts is missing (is this InferencePool v1?)")
    ports = []
    for index, entry in enumerate(target_ports):
        number = entry.get("number") if isinstance(entry, Mapping) else None
        if not isinstance(number, int) or isinstance(number, bool):
            raise PoolSpecError(f"{name}: spec.targetPorts[{index}].number is not an integer")
        ports.append(number)
    return PoolSpec(
        selector=tuple(sorted((str(k), v) for k, v in match_labels.items())),
        target_ports=_check_ports(ports, f"{name}: spec.targetPorts"),
    )


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready condition True, not terminating, and a pod IP to dial."""
    metadata = pod.get("metadata") or {}
    if metadata.get("deletionTimestamp"):
        return False
    status = pod.get("status") or {}
    if not status.get("podIP"):
        return False
    for condition in status.get("conditions") or ():
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def active_ports(pod: Mapping[str, Any], target_ports: tuple[int, ...]) -> frozenset[int]:
    """The target ports the Pod serves on: all of them, or those its active-ports annotation lists."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    for key in ACTIVE_PORTS_ANNOTATIONS:
        value = annotations.get(key)
        if value is not None:
            listed = set()
            for item in str(value).split(","):
                item = item.strip()
                if item.isascii() and item.isdigit():
                    listed.add(int(item))
            return frozenset(port for port in target_ports if port in listed)
    return frozenset(target_ports)


def named_port(pod: Mapping[str, Any], name: str) -> int:
    """The number of the Pod's container port called ``name`` (the first container that has it), 0 if none."""
    for container in (pod.get("spec") or {}).get("containers") or ():
        if not isinstance(container, Mapping):
            continue
        for port in container.get("ports") or ():
            if isinstance(port, Mapping) and port.get("name") == name:
                number = port.get("containerPort")
                if isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536:
                    return number
                log.warning("pod %s: container port %s is %r, not a port number; ignored",
                            (pod.get("metadata") or {}).get("name", "?"), name, number)
                return 0
    return 0


def pod_endpoints(pod: Mapping[str, Any], target_ports: tuple[int, ...]) -> list[Endpoint]:
    """The endpoints one Pod contributes (none unless it is ready; see the module docstring)."""
    if not pod_is_ready(pod):
        return []
    metadata = pod.get("metadata") or {}
    name = metadata.get("name", "")
    ip_text = str((pod.get("status") or {}).get("podIP", ""))
    try:
        address = str(ipaddress.ip_address(ip_text))
    except ValueError:
        log.warning("pod %s: podIP %r is not an IP address; skipped", name, ip_text)
        return []
    labels = MappingProxyType({str(k): str(v) for k, v in (metadata.get("labels") or {}).items()})
    ports = active_ports(pod, target_ports)
    kv_events, kv_replay = named_port(pod, KV_EVENTS_PORT_NAME), named_port(pod, KV_REPLAY_PORT_NAME)
    return [
        Endpoint(name=f"{name}-rank-{rank}", address=address, port=port, labels=labels,
                 kv_events_port=kv_events + rank if kv_events else 0,
                 kv_replay_port=kv_replay + rank if kv_replay else 0)
        for rank, port in enumerate(target_ports)
        if port in ports
    ]


def endpoints_for(pods: Iterable[Mapping[str, Any]], target_ports: tuple[int, ...]) -> list[Endpoint]:
    """Every endpoint of ``pods``, in pod-name order (so the result does not depend on event order)."""
    ordered = sorted(pods, key=lambda pod: (pod.get("metadata") or {}).get("name", ""))
    return [endpoint for pod in ordered for endpoint in pod_endpoints(pod, target_ports)]
