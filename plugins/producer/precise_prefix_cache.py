"""``precise-prefix-cache-producer``: PREFIX_MATCH from the pods' own KV-cache events (llm-d's type name).

Where the approximate producer predicts what a pod holds from what this picker sent it, this one
follows what the pods say they hold: a :class:`epp.prefix.kvsubscriber.KVEventSubscriber` connects to
each pod's publisher (``tcp://<pod ip>:<socketPort>``, llm-d's ``podDiscoveryConfig.socketPort``, 5557,
the port of vLLM's default ``endpoint: tcp://*:5557``), or, with ``kvEventsConfig.zmqEndpoint``, binds
that endpoint for pods configured to connect to it (only pods of the pool, from their own address, are
accepted). The events fill a :class:`epp.prefix.kvindex.KVEventIndex` keyed by this picker's hash of
the blocks' token ids; a request is looked up with its own token ids, cut into the events' block size.

Token ids come from a :data:`Tokenizer`: a callable from the request to its prompt's token ids (None
when it cannot tell). None is configured by default, and then every pod is scored by the approximate
index: tokenizing from the served model's local files (HF ``tokenizers`` with the chat template in
jinja2) is the next step, not built yet, and nothing is ever downloaded.

A pool may mix pods that publish events with pods that do not: an inner
:class:`ApproxPrefixCacheProducer` (same parameters) keeps running, and a pod's match is the precise one
while the index :meth:`~epp.prefix.kvindex.KVEventIndex.known`\\s the pod, else the approximate one
scaled to the precise blocks. Matches count blocks weighted by medium (a CPU block 0.8), rounded down.

Parameters (llm-d's names where they exist, plus the approximate producer's):
    kvEventsConfig.zmqEndpoint (str): bind this endpoint for pods that connect (default: connect to pods).
    kvEventsConfig.topicFilter (str, default "kv@"): the topic prefix subscribed to.
    podDiscoveryConfig.socketPort (int, default 5557): the pods' publisher port (rank r on port + r).
    tokenProcessorConfig.blockSize (int, default 16): tokens per block of a lookup before any event said.
    tokenProcessorConfig.hashSeed (int, default 0): the seed of this picker's block keys.
    maxBlocksPerPod (int, default 1048576): this project's bound on the blocks remembered per pod.

Metrics (gauges, over the pool): ``epp_kv_events`` (events applied), ``epp_kv_event_gaps``,
``epp_kv_event_replays``, ``epp_kv_event_resets``, ``epp_kv_event_decode_errors``,
``epp_kv_event_pods_tracked``, ``epp_kv_event_index_blocks`` and ``epp_kv_event_lag_seconds`` (the
median of the last batches' publisher-to-index lag).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from epp.framework import (
    PREFIX_MATCH,
    Endpoint,
    Handle,
    InferenceRequest,
    PrefixMatch,
    SchedulingResult,
    check_parameters,
)
from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvsubscriber import KVEventSubscriber, pod_id

from .approx_prefix_cache import ApproxPrefixCacheProducer, PrefixParameters

__all__ = ["PreciseParameters", "PrecisePrefixCacheProducer", "Tokenizer"]

Tokenizer = Callable[[InferenceRequest], Sequence[int] | None]

_OWN = ("kvEventsConfig", "podDiscoveryConfig", "tokenProcessorConfig", "maxBlocksPerPod", "discoverPods")


class PreciseParameters:
    def __init__(self, name: str, parameters: Mapping[str, Any]) -> None:
        def section(key: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
            value = parameters.get(key) or {}
            if not isinstance(value, Mapping):
                raise ValueError(f"{name}: {key} must be a mapping, got {value!r}")
            check_parameters(f"{name}: {key}", value, allowed)
            return value

        def integer(where: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
            value = where.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}: {key} must be an integer ≥ {minimum}, got {value!r}")
            return value

        events = section("kvEventsConfig", ("zmqEndpoint", "topicFilter", "concurrency"))
        discovery = section("podDiscoveryConfig", ("socketPort",))
        tokens = section("tokenProcessorConfig", ("blockSize", "hashSeed"))
        self.bind: str | None = events.get("zmqEndpoint") or None
        self.topic_filter = str(events.get("topicFilter", "kv@"))
        self.socket_port = integer(discovery, "socketPort", 5557, 1)
        self.block_size = integer(tokens, "blockSize", 16, 1)
        self.hash_seed = integer(tokens, "hashSeed", 0, 0)
        self.max_blocks_per_pod = integer(parameters, "maxBlocksPerPod", 1 << 20, 1)
        self.approximate = PrefixParameters.parse(name, {k: v for k, v in parameters.items() if k not in _OWN})


class PrecisePrefixCacheProducer:
    produces = (PREFIX_MATCH,)

    def __init__(
        self,
        name: str = "precise-prefix-cache-producer",
        parameters: PreciseParameters | None = None,
        handle: Handle | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.name = name
        self.parameters = p = parameters or PreciseParameters(name, {})
        self.tokenizer = tokenizer
        self.approximate = ApproxPrefixCacheProducer(f"{name}/approximate", p.approximate, handle)
        self.index = KVEventIndex(seed=p.hash_seed, max_blocks_per_pod=p.max_blocks_per_pod)
        self.subscriber: KVEventSubscriber | None = None
        self._names: dict[str, str] = {}  # index pod id -> endpoint name
        self._endpoints: dict[str, Endpoint] = {}
        if handle is not None:
            handle.pool.subscribe(self._pool_changed)
            self._pool_changed(tuple(handle.pool.endpoints()), ())
            self._export(handle)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        return cls(name, PreciseParameters(name, parameters), handle)

    def _export(self, handle: Handle) -> None:
        def stat(attr: str) -> Callable[[], float]:
            return lambda: float(getattr(self.subscriber.stats, attr)) if self.subscriber else 0.0

        m = handle.metrics
        m.gauge_sum("epp_kv_events", "KV-cache events applied to the precise prefix index.", stat("events"))
        m.gauge_sum("epp_kv_event_gaps", "Holes in pods' KV-event sequence numbers.", stat("gaps"))
        m.gauge_sum("epp_kv_event_replays", "KV-event holes filled from a replay endpoint.", stat("replays"))
        m.gauge_sum("epp_kv_event_resets", "KV-event publisher restarts (seq back to 0).", stat("resets"))
        m.gauge_sum("epp_kv_event_decode_errors", "KV-event messages that did not decode.", stat("decode_errors"))
        m.gauge_sum("epp_kv_event_pods_tracked", "Pods in the precise prefix index.", lambda: self.index.stats().pods)
        blocks = "Blocks in the precise prefix index."
        m.gauge_sum("epp_kv_event_index_blocks", blocks, lambda: self.index.stats().blocks)
        m.gauge_sum("epp_kv_event_lag_seconds", "Median publisher-to-index lag of recent batches.", self._lag)

    def _lag(self) -> float:
        lags = self.subscriber.stats.lags if self.subscriber else []
        return statistics.median(lags) if lags else 0.0

    def _ensure_subscriber(self) -> KVEventSubscriber | None:
        if self.subscriber is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return None  # built before the loop runs: the first pool change or request on it starts it
            p = self.parameters
            self.subscriber = KVEventSubscriber(self.index, topic_filter=p.topic_filter, bind=p.bind)
            self.subscriber.start()
            for endpoint in self._endpoints.values():
                self._follow(endpoint)
        return self.subscriber

    def _follow(self, endpoint: Endpoint) -> None:
        subscriber = self.subscriber
        if subscriber is None:
            return
        if self.parameters.bind is not None:
            subscriber.allow(endpoint.hostport)
        else:
            host = f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address
            subscriber.follow(pod_id(endpoint.hostport), f"tcp://{host}:{self.parameters.socket_port}")

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        still_here = {endpoint.hostport for endpoint in added}
        for endpoint in removed:
            if endpoint.hostport not in still_here:
                self._endpoints.pop(endpoint.hostport, None)
                self._names.pop(pod_id(endpoint.hostport), None)
                if self.subscriber is not None:
                    self.subscriber.unfollow(pod_id(endpoint.hostport))
        for endpoint in added:
            self._endpoints[endpoint.hostport] = endpoint
            self._names[pod_id(endpoint.hostport)] = endpoint.name
        if self._ensure_subscriber() is not None:
            for endpoint in added:
                self._follow(endpoint)

    def produce(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        self._ensure_subscriber()
        self.approximate.produce(request, candidates)
        token_ids = self.tokenizer(request) if self.tokenizer is not None else None
        if not token_ids:
            return  # the approximate match stands for every pod
        block_size = self.index.block_size() or self.parameters.block_size
        max_blocks = max(1, self.parameters.approximate.max_prefix_tokens // block_size)
        keys = chain_keys(token_ids, block_size, self.parameters.hash_seed, max_blocks)
        approx = request.state.get(PREFIX_MATCH)
        matched: dict[str, int] = {}
        if approx is not None and keys:
            for name in approx.matched:
                matched[name] = int(approx.share(name) * len(keys))
        for pod, (_, weighted) in self.index.match(keys).items():
            name = self._names.get(pod, pod)
            matched[name] = int(weighted + 1e-9)
        for pod, name in self._names.items():
            if self.index.known(pod) and pod not in self.index.match(keys[:1]):
                matched.pop(name, None)  # a known pod without the first block holds nothing of it
        request.state[PREFIX_MATCH] = PrefixMatch(len(keys), matched, block_size)

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self.approximate.pre_request(request, result)

    async def close(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.close()
            self.subscriber = None
