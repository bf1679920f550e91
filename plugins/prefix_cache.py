"""``approx-prefix-cache-producer`` and ``prefix-cache-scorer``: send a prompt where its prefix is cached.

The producer predicts, without asking the pods, which pod holds a prompt's prefix in its KV-cache:
it remembers which prompt blocks it sent where, in an :class:`epp.prefix.index.PrefixIndex` (see
that module for the hashing, the per-pod eviction policy and the costs). The prompt is cut into
blocks of ``blockSizeTokens`` × 4 characters; each block's 64-bit hash chains the previous
block's, seeded by the model name and the request's ``cache_salt``, so equal hashes at block *i*
mean an equal prefix through block *i*. Each pod holds at most ``lruCapacityPerServer`` block
hashes (with ``autoTune``, the pod's own ``num_gpu_blocks`` from ``vllm:cache_config_info`` once
scraped), evicting the oldest first (by generations, an approximation of an LRU). Before
scheduling, the producer puts every pod's longest consecutive matched prefix into
``request.state["prefix-cache-match"]``; after the pick (``pre_request``) it records the prompt's
blocks on the chosen pod, before the response arrives, so a burst of one prefix sticks to one
pod. Pods are registered with the index as they join the pool (so that it can size itself for
their capacities) and dropped from it when they leave.

The scorer gives each candidate matched blocks / prompt blocks (0 for a prompt shorter than a
block). Configured alone, as upstream configs do, it brings its own producer built from its own
parameters.

Parameters (both plugins; upstream names):
    blockSizeTokens (int, default 16): tokens per block (4 characters per token).
    blockSize (int): upstream's older spelling, in characters (64 = 16 tokens); hashBlockSize is llm-d's.
    maxPrefixTokensToMatch (int, default 131072): tokens of prompt considered.
    maxPrefixBlocksToMatch (int): the same, in blocks (upstream's older spelling).
    lruCapacityPerServer (int, default 31250): blocks remembered per pod.
    autoTune (bool, default true): use each pod's num_gpu_blocks as its capacity when known.

Metrics: ``inference_extension_prefix_indexer_size`` (blocks indexed over all pods),
``inference_extension_prefix_indexer_hit_ratio`` (histogram of the share of the prompt's blocks the
picked pod already held, as recording the pick found it) and ``epp_prefix_indexer_bytes``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from epp.datalayer.datastore import Endpoint
from epp.prefix import (
    CHARS_PER_TOKEN,
    DEFAULT_BLOCK_SIZE_TOKENS,
    DEFAULT_LRU_CAPACITY_PER_SERVER,
    DEFAULT_MAX_PREFIX_TOKENS,
    PrefixIndex,
    prompt_hashes,
)
from epp.scheduling.registry import Handle, check_parameters
from epp.extproc.parsing import InferenceRequest
from epp.scheduling.runner import SchedulingResult

__all__ = ["ApproxPrefixCacheProducer", "PrefixCacheScorer", "PrefixMatch", "PrefixParameters"]

MATCH = "prefix-cache-match"

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


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What the producer found for one request: its block hashes and each candidate's match."""

    hashes: np.ndarray  # the prompt's chained block hashes (uint64)
    matched: Mapping[str, int]  # endpoint name -> consecutive blocks matched from the start (absent: 0)

    @property
    def blocks(self) -> int:
        return len(self.hashes)


class ApproxPrefixCacheProducer:
    produces = (MATCH,)

    def __init__(self, name: str = "approx-prefix-cache-producer", parameters: PrefixParameters = PrefixParameters(), handle: Handle | None = None) -> None:
        self.name = name
        self.parameters = parameters
        self.index = PrefixIndex(default_capacity=parameters.lru_capacity_per_server)
        self._size_gauge = self._hit_ratio = None
        if handle is not None:
            handle.datastore.subscribe(self._pool_changed)
            self._pool_changed(handle.datastore.endpoints(), ())
            if handle.registry is not None:
                self._export(handle.registry)

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        return cls(name, PrefixParameters.parse(name, parameters), handle)

    def _export(self, registry: Any) -> None:
        from prometheus_client import Gauge, Histogram

        index = self.index
        size = Gauge("inference_extension_prefix_indexer_size", "Prompt blocks in the prefix-cache index, over all pods.", registry=registry)
        size.set_function(lambda: index.size)
        memory = Gauge("epp_prefix_indexer_bytes", "Memory held by the prefix-cache index.", registry=registry)
        memory.set_function(lambda: index.nbytes)
        self._hit_ratio = Histogram(
            "inference_extension_prefix_indexer_hit_ratio",
            "Share of the prompt's blocks the picked pod was predicted to hold.",
            buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=registry,
        )

    def _capacity(self, endpoint: Endpoint) -> int:
        blocks = endpoint.metrics.num_gpu_blocks if self.parameters.auto_tune else None
        return blocks if blocks else self.parameters.lru_capacity_per_server

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
        # Every pod's match, not only the candidates': one lookup either way, and add() after the
        # pick reuses it rather than looking the prompt up again.
        request.state[MATCH] = PrefixMatch(hashes, self.index.matches(hashes) if hashes.size else {})

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        match: PrefixMatch | None = request.state.get(MATCH)
        endpoints = result.endpoints
        if match is None or not endpoints or not match.blocks:
            return
        endpoint = endpoints[0]
        if self.parameters.auto_tune and endpoint.metrics.num_gpu_blocks:
            self.index.set_capacity(endpoint.name, endpoint.metrics.num_gpu_blocks)  # a no-op when unchanged
        held = self.index.add(endpoint.name, match.hashes)
        if self._hit_ratio is not None:
            self._hit_ratio.observe(held / match.blocks)


class PrefixCacheScorer:
    consumes = (MATCH,)

    def __init__(self, name: str = "prefix-cache-scorer", parameters: Mapping[str, Any] | None = None) -> None:
        self.name = name
        # What the producer added for this scorer (when the config has none) is built from.
        self.producer_parameters = dict(parameters or {})

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        PrefixParameters.parse(name, parameters)  # refuse bad parameters here, naming this plugin
        return cls(name, parameters)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        match: PrefixMatch | None = request.state.get(MATCH)
        if match is None or not match.blocks:
            return [0.0] * len(candidates)
        total = match.blocks
        matched = match.matched
        return [matched.get(endpoint.name, 0) / total for endpoint in candidates]
