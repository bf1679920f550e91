"""``approx-prefix-cache-producer``: predict which pod holds a prompt's prefix in its KV-cache.

The producer predicts, without asking the pods, which pod holds a prompt's prefix in its KV-cache:
it remembers which prompt blocks it sent where, in an :class:`epp.prefix.PrefixIndex` (see
that module for the hashing, the per-pod eviction policy and the costs). The prompt is cut into
blocks of ``blockSizeTokens`` × 4 characters; each block's 64-bit hash chains the previous
block's, seeded by the model name and the request's ``cache_salt``, so equal hashes at block *i*
mean an equal prefix through block *i*. Each pod holds at most ``lruCapacityPerServer`` block
hashes (with ``autoTune``, the pod's own capacity once scraped: its cache in tokens, from
``vllm:cache_config_info``'s ``kv_cache_size_tokens`` or ``num_gpu_blocks`` x ``block_size``, divided by
the index's own ``blockSizeTokens``: vLLM on CPU uses 128-token blocks, 8 of the index's), evicting
the oldest first (by generations, an approximation of an LRU). Before
scheduling, the producer puts every pod's longest consecutive matched prefix into
``request.state[PREFIX_MATCH]`` (:data:`epp.framework.PREFIX_MATCH`, which ``prefix-cache-scorer``
reads); after the pick (``pre_request``) it records the prompt's
blocks on the chosen pod, before the response arrives, so a burst of one prefix sticks to one
pod. Pods are registered with the index as they join the pool (so that it can size itself for
their capacities) and dropped from it when they leave.

It declares itself the default producer of that key: a config that lists ``prefix-cache-scorer``
alone, as upstream configs do, gets one, built from the scorer's parameters.

Parameters (upstream names; ``prefix-cache-scorer`` takes the same ones):
    blockSizeTokens (int, default 16): tokens per block (4 characters per token).
    blockSize (int): upstream's older spelling, in characters (64 = 16 tokens); hashBlockSize is llm-d's.
    maxPrefixTokensToMatch (int, default 131072): tokens of prompt considered.
    maxPrefixBlocksToMatch (int): the same, in blocks (upstream's older spelling).
    lruCapacityPerServer (int, default 31250): blocks remembered per pod.
    autoTune (bool, default true): use each pod's own cache size as its capacity when known.

Metrics: ``inference_extension_prefix_indexer_size`` (blocks indexed over all pods),
``inference_extension_prefix_indexer_hit_ratio`` (histogram of the share of the prompt's blocks the
picked pod already held, as recording the pick found it) and ``epp_prefix_indexer_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, cast

from epp.framework import (
    PREFIX_MATCH,
    Endpoint,
    Handle,
    InferenceRequest,
    PrefixMatch,
    SchedulingResult,
    StateKey,
    check_parameters,
    default_producer_of,
)
from epp.prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_BLOCK_SIZE_TOKENS,
    DEFAULT_LRU_CAPACITY_PER_SERVER,
    DEFAULT_MAX_PREFIX_TOKENS,
    PrefixIndex,
    PrefixLookup,
    prompt_hashes,
)

if TYPE_CHECKING:
    from prometheus_client import Histogram

__all__ = ["ApproxPrefixCacheProducer", "PrefixParameters"]

_PARAMETERS = (
    "blockSizeTokens",
    "blockSize",
    "hashBlockSize",
    "maxPrefixTokensToMatch",
    "maxPrefixBlocksToMatch",
    "lruCapacityPerServer",
    "autoTune",
)
_CHARS_PER_TOKEN = CHARS_PER_TOKEN
_DEFAULT_BLOCK_TOKENS = DEFAULT_BLOCK_SIZE_TOKENS
_DEFAULT_MAX_PREFIX_TOKENS = DEFAULT_MAX_PREFIX_TOKENS
_DEFAULT_LRU_CAPACITY = DEFAULT_LRU_CAPACITY_PER_SERVER


@dataclass(frozen=True, slots=True)
class PrefixParameters:
    block_size_tokens: int = _DEFAULT_BLOCK_TOKENS
    max_prefix_tokens: int = _DEFAULT_MAX_PREFIX_TOKENS
    lru_capacity_per_server: int = _DEFAULT_LRU_CAPACITY
    auto_tune: bool = True

    @property
    def block_chars(self) -> int:
        return self.block_size_tokens * _CHARS_PER_TOKEN

    @property
    def max_blocks(self) -> int:
        return max(1, self.max_prefix_tokens // self.block_size_tokens)

    @classmethod
    def parse(cls, name: str, parameters: Mapping[str, Any]) -> Self:
        check_parameters(name, parameters, _PARAMETERS)

        def integer(key: str, minimum: int = 1) -> int | None:
            if key not in parameters:
                return None
            value = parameters[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}: {key} must be an integer ≥ {minimum}, got {value!r}")
            return value

        block_tokens = integer("blockSizeTokens")
        for key in ("blockSize", "hashBlockSize"):
            chars = integer(key)
            if chars is not None:
                if block_tokens is not None:
                    raise ValueError(f"{name}: give one of blockSizeTokens, blockSize, hashBlockSize")
                block_tokens = max(1, chars // _CHARS_PER_TOKEN)
        block_tokens = block_tokens or _DEFAULT_BLOCK_TOKENS
        max_tokens = integer("maxPrefixTokensToMatch")
        max_blocks = integer("maxPrefixBlocksToMatch")
        if max_tokens is not None and max_blocks is not None:
            raise ValueError(f"{name}: give one of maxPrefixTokensToMatch, maxPrefixBlocksToMatch")
        if max_blocks is not None:
            max_tokens = max_blocks * block_tokens
        auto_tune = parameters.get("autoTune", True)
        if not isinstance(auto_tune, bool):
            raise ValueError(f"{name}: autoTune must be true or false, got {auto_tune!r}")
        return cls(
            block_size_tokens=block_tokens,
            max_prefix_tokens=max_tokens or _DEFAULT_MAX_PREFIX_TOKENS,
            lru_capacity_per_server=integer("lruCapacityPerServer") or _DEFAULT_LRU_CAPACITY,
            auto_tune=auto_tune,
        )


class ApproxPrefixCacheProducer:
    produces = (PREFIX_MATCH,)
    # Added for a config that lists prefix-cache-scorer alone, as upstream configs do.
    default_for = (default_producer_of(PREFIX_MATCH),)

    def __init__(
        self,
        name: str = "approx-prefix-cache-producer",
        parameters: PrefixParameters | None = None,
        handle: Handle | None = None,
    ) -> None:
        self.name = name
        self.parameters = parameters = parameters or PrefixParameters()
        self.index = PrefixIndex(default_capacity=parameters.lru_capacity_per_server)
        # This instance's own lookup of the prompt, which add() reuses after the pick.
        self._lookup: StateKey[PrefixLookup] = StateKey(f"{name}/prompt-lookup")
        self._hit_ratio: Histogram | None = None
        if handle is not None:
            handle.pool.subscribe(self._pool_changed)
            self._pool_changed(tuple(handle.pool.endpoints()), ())
            self._export(handle)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        return cls(name, PrefixParameters.parse(name, parameters), handle)

    def _export(self, handle: Handle) -> None:
        index, metrics = self.index, handle.metrics
        metrics.gauge_sum(
            "inference_extension_prefix_indexer_size",
            "Prompt blocks in the prefix-cache index, over all pods.",
            lambda: index.size,
        )
        metrics.gauge_sum("epp_prefix_indexer_bytes", "Memory held by the prefix-cache index.", lambda: index.nbytes)
        self._hit_ratio = metrics.histogram(
            "inference_extension_prefix_indexer_hit_ratio",
            "Share of the prompt's blocks the picked pod was predicted to hold.",
            buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
        )

    def _capacity(self, endpoint: Endpoint) -> int:
        return self._tuned_capacity(endpoint) or self.parameters.lru_capacity_per_server

    def _tuned_capacity(self, endpoint: Endpoint) -> int | None:
        """The pod's cache in the index's blocks (autoTune), None when unknown or not tuned."""
        if not self.parameters.auto_tune:
            return None
        metrics = endpoint.metrics
        tokens = metrics.cache_tokens
        if tokens:
            return max(1, tokens // self.parameters.block_size_tokens)
        # Blocks of an unknown size: the index's own size is the only guess there is.
        return metrics.num_gpu_blocks or None

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        still_here = {endpoint.name for endpoint in added}
        for endpoint in removed:
            if endpoint.name not in still_here:  # a re-label is a remove + add of the same name
                self.index.remove(endpoint.name)
        for endpoint in added:  # known capacities let the index size its table ahead of the blocks
            if endpoint.name not in self.index:
                self.index.set_capacity(endpoint.name, self._capacity(endpoint))

    def produce(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        p = self.parameters
        hashes = prompt_hashes(request.prompt, request.model, request.cache_salt, p.block_chars, p.max_blocks)
        if not hashes.size:
            request.state[PREFIX_MATCH] = PrefixMatch(0, {}, p.block_size_tokens)
            return
        # Every pod's match, not only the candidates': one lookup either way, and add() after the
        # pick reuses it (unless the index changed since) rather than looking the prompt up again.
        lookup = self.index.lookup(hashes)
        request.state[self._lookup] = lookup
        request.state[PREFIX_MATCH] = PrefixMatch(
            len(hashes), cast(Mapping[str, int], lookup.matches), p.block_size_tokens
        )

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        lookup = request.state.get(self._lookup)
        endpoints = result.endpoints
        if lookup is None or not endpoints:
            return
        endpoint = endpoints[0]
        capacity = self._tuned_capacity(endpoint)
        if capacity:
            self.index.set_capacity(endpoint.name, capacity)  # a no-op when unchanged
        held = self.index.add(endpoint.name, lookup.hashes, lookup=lookup)
        if self._hit_ratio is not None:
            self._hit_ratio.observe(held / len(lookup.hashes))
