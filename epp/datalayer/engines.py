"""The engine tables: which metrics of each model server's page fill which field the picker reads.

What is wanted is an :class:`EngineMapping`: per engine, one *metric selector* per field
(:mod:`epp.datalayer.selectors`, upstream's ``engineConfigs`` syntax). Built-in mappings exist for
vLLM, SGLang, trtllm-serve and Triton's TensorRT-LLM backend (:func:`builtin_engines`), selected per
pod by the ``inference.networking.k8s.io/engine-type`` label (:func:`engine_for_label`);
:func:`engine_from_config` builds one from upstream's config keys. :meth:`EngineMapping.parse` reads
one page with the page reader (:mod:`epp.datalayer.page`) into an :class:`EngineMetrics`.

How the fields are filled (the parser never raises on the page's content):

* a selector matching several series (per ``model_name``, per data-parallel ``engine``): queue and
  running counts are **summed** (the pod's total work), KV-cache usage and the cache-geometry gauges
  take the **maximum** (the most loaded engine is the one that preempts first); info-style metrics
  (``cache_config_info``) take the first matching series, the LoRA metric its newest series;
* a field takes a tuple of alternative selectors: the first with a usable sample wins (vLLM's
  ``kv_cache_usage_perc`` replaced ``gpu_cache_usage_perc``);
* the cache geometry comes from ``cache_info``'s labels, or from the two gauges when it gives none;
* a field whose selectors match nothing usable is ``None`` and its selectors are listed in
  :attr:`EngineMetrics.missing`; a field with no selector (disabled) is ``None`` and not listed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from epp.datalayer.page import CacheInfoLabels, CompiledSelector, Page, read_page, sample_runs

# Selector and parse_selector are re-exported: they are the vocabulary of EngineMapping's fields.
from epp.datalayer.selectors import Selector, is_label_name, parse_selector

__all__ = [
    "ENGINE_TYPE_LABEL",
    "LLMD_ENGINE_TYPE_LABEL",
    "EngineMapping",
    "EngineMetrics",
    "Selector",
    "builtin_engines",
    "engine_for_label",
    "engine_from_config",
    "parse_selector",
]

ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
"""The pod label that names the engine (upstream GIE's default ``engineLabelKey``)."""
LLMD_ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
"""The same label under llm-d-router's name (which still falls back to :data:`ENGINE_TYPE_LABEL`)."""


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape of one pod says, in the engine-neutral terms the scheduler uses."""

    waiting_queue_size: int | None
    """Requests queued in the engine."""
    running_requests: int | None
    """Requests in the running batch."""
    kv_cache_usage: float | None
    """Fraction of the KV cache in use, 0..1."""
    running_adapters: frozenset[str]
    """LoRA adapters in the running batch."""
    waiting_adapters: frozenset[str]
    """LoRA adapters of queued requests."""
    max_adapters: int | None
    """Adapters the engine can hold at once (vLLM's ``max_lora``)."""
    block_size: int | None
    """Tokens per KV-cache block."""
    num_gpu_blocks: int | None
    """KV-cache blocks on the GPU."""
    missing: tuple[str, ...]
    """Selectors (or ``selector label name``) configured but not found usable on the page: an error state."""
    kv_cache_size_tokens: int | None = None
    """The KV cache's capacity in tokens, when the engine says it (vLLM's ``cache_config_info`` label);
    optional, never missing: ``num_gpu_blocks x block_size`` stands in for it."""


_NO_ADAPTERS: frozenset[str] = frozenset()


class _Plan(NamedTuple):
    """A mapping's selectors compiled for the page reader, once per mapping."""

    queued: tuple[CompiledSelector, ...]
    running: tuple[CompiledSelector, ...]
    kv: tuple[CompiledSelector, ...]
    lora: CompiledSelector | None
    info: CompiledSelector | None
    info_labels: CacheInfoLabels
    block_size_gauges: tuple[CompiledSelector, ...]
    num_blocks_gauges: tuple[CompiledSelector, ...]


# --------------------------------------------------------------------------------------------- mappings


@dataclass(frozen=True, slots=True)
class EngineMapping:
    """Which metrics of one engine's page fill which :class:`EngineMetrics` field.

    Count, usage and gauge fields take a tuple of alternatives: the first selector with a usable
    sample wins (vLLM's ``kv_cache_usage_perc`` replaced ``gpu_cache_usage_perc``). An empty tuple
    or ``None`` disables the field. Immutable; :meth:`parse` may be called from anywhere.
    """

    name: str
    """The engine, as the engine-type pod label names it: ``vllm``, ``sglang``, ``trtllm-serve``, ..."""
    queued_requests: tuple[Selector, ...] = ()
    running_requests: tuple[Selector, ...] = ()
    kv_usage: tuple[Selector, ...] = ()
    lora: Selector | None = None
    cache_info: Selector | None = None
    """An info-style metric whose labels carry the block size and the number of blocks."""
    cache_block_size_label: str = "block_size"
    cache_num_blocks_label: str = "num_gpu_blocks"
    cache_size_tokens_label: str = "kv_cache_size_tokens"
    """The optional label of ``cache_info`` with the cache's capacity in tokens."""
    cache_block_size: tuple[Selector, ...] = ()
    """Block size as a gauge value, used when ``cache_info`` gives none."""
    cache_num_blocks: tuple[Selector, ...] = ()
    """Number of GPU blocks as a gauge value, used when ``cache_info`` gives none."""
    filter_path: str | None = None
    """Where the engine honours ``?name[]=`` for the page it serves at ``/metrics``, when that is another
    path. vLLM 0.32 serves ``/metrics`` through prometheus-fastapi-instrumentator, which ignores the
    query, and the same page at ``/metrics/`` through prometheus_client's own app, which honours it
    (vllm/entrypoints/serve/instrumentator/metrics.py: the instrumentator's route is registered before
    the prometheus_client mount, whose pattern matches ``/metrics`` and everything under it)."""
    _plan: _Plan = field(init=False, repr=False, compare=False)
    _sample_runs: re.Pattern[bytes] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def many(sels: tuple[Selector, ...]) -> tuple[CompiledSelector, ...]:
            if not isinstance(sels, tuple) or not all(isinstance(s, Selector) for s in sels):
                raise TypeError(f"engine {self.name!r}: expected a tuple of Selector, got {sels!r}")
            return tuple(CompiledSelector(s) for s in sels)

        def one(sel: Selector | None) -> CompiledSelector | None:
            if sel is not None and not isinstance(sel, Selector):
                raise TypeError(f"engine {self.name!r}: expected a Selector or None, got {sel!r}")
            return None if sel is None else CompiledSelector(sel)

        labels = (self.cache_block_size_label, self.cache_num_blocks_label, self.cache_size_tokens_label)
        block_size, num_blocks, size_tokens = (n.encode() for n in labels)
        plan = _Plan(
            many(self.queued_requests), many(self.running_requests), many(self.kv_usage), one(self.lora),
            one(self.cache_info),
            ((block_size, block_size + b'="'), (num_blocks, num_blocks + b'="'), (size_tokens, size_tokens + b'="')),
            many(self.cache_block_size), many(self.cache_num_blocks),
        )  # fmt: skip
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_sample_runs", sample_runs(self.metric_names()))

    def metric_names(self) -> tuple[str, ...]:
        """Every metric name this mapping may read, in a stable order, without duplicates.

        A scraper can ask a prometheus_client-based server (vLLM, SGLang) for just these
        (``?name[]=...``) instead of the whole page.
        """
        selectors = [
            *self.queued_requests, *self.running_requests, *self.kv_usage,
            *(s for s in (self.lora, self.cache_info) if s is not None),
            *self.cache_block_size, *self.cache_num_blocks,
        ]  # fmt: skip
        return tuple(dict.fromkeys(selector.name for selector in selectors))

    def parse(self, page: bytes) -> EngineMetrics:
        """Extract this engine's values from one ``/metrics`` page (any bytes-like object).

        Never raises on the page's content: an HTML error page, a truncated body or random bytes give
        ``None`` fields, each listed in :attr:`EngineMetrics.missing`.
        """
        if not isinstance(page, bytes):
            page = bytes(page)
        return self._extract(read_page(page, self._sample_runs))

    def _extract(self, scan: Page) -> EngineMetrics:
        queued, running, kv, lora, info, info_labels, bs_gauges, nb_gauges = self._plan
        missing: list[str] = []
        waiting_n = scan.total(queued, missing)
        running_n = scan.total(running, missing)
        usage = scan.largest(kv, missing)
        running_a = waiting_a = _NO_ADAPTERS
        max_a = None
        if lora is not None:
            running_a, waiting_a, max_a = scan.lora(lora, missing)
        block_size = num_blocks = size_tokens = None
        info_missing: list[str] = []
        if info is not None:
            block_size, num_blocks, size_tokens = scan.cache_info(info, info_labels, info_missing)
        if block_size is None and bs_gauges:
            value = scan.largest(bs_gauges, info_missing)
            block_size = None if value is None else round(value)
        if num_blocks is None and nb_gauges:
            value = scan.largest(nb_gauges, info_missing)
            num_blocks = None if value is None else round(value)
        if block_size is None or num_blocks is None:
            missing.extend(dict.fromkeys(info_missing))
        return EngineMetrics(
            waiting_queue_size=waiting_n,
            running_requests=running_n,
            kv_cache_usage=usage,
            running_adapters=running_a,
            waiting_adapters=waiting_a,
            max_adapters=max_a,
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            missing=tuple(missing),
            kv_cache_size_tokens=size_tokens,
        )


# --------------------------------------------------------------------------------------------- built-ins


def _sels(*texts: str) -> tuple[Selector, ...]:
    return tuple(parse_selector(t) for t in texts)


# Metric names: vLLM v1 (vllm/v1/metrics/loggers.py), SGLang (sglang/srt/metrics/collector.py),
# trtllm-serve's /prometheus/metrics, Triton's TensorRT-LLM backend; the selectors are upstream's
# built-in engineConfigs (llm-d-router extractor/metrics/factories.go), plus two fallbacks noted below.
_BUILTINS = (
    EngineMapping(
        "vllm",
        queued_requests=_sels("vllm:num_requests_waiting"),
        running_requests=_sels("vllm:num_requests_running"),
        # gpu_cache_usage_perc: the name before vLLM 0.10 (deprecated since, still served by some).
        kv_usage=_sels("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora=parse_selector("vllm:lora_requests_info"),
        cache_info=parse_selector("vllm:cache_config_info"),
        filter_path="/metrics/",
    ),
    EngineMapping(
        "sglang",
        # With --enable-priority-scheduling, SGLang (0.5.23: observability/metrics_collector.py,
        # _log_gauge_queue_count) writes each queue twice: the total under priority="" and one series
        # per priority under priority="<n>"; summing every series would double the queue. priority=""
        # also matches a page without the label (PromQL's rule), so it reads both set-ups.
        queued_requests=_sels('sglang:num_queue_reqs{priority=""}'),
        running_requests=_sels('sglang:num_running_reqs{priority=""}'),
        kv_usage=_sels("sglang:token_usage"),
        # Before 0.5.11 the geometry was labels of cache_config_info; 0.5.11 on (0.5.23 included)
        # serves no cache_config_info, only the page_size and num_pages gauges read below.
        cache_info=parse_selector("sglang:cache_config_info"),
        cache_block_size_label="page_size",
        cache_num_blocks_label="num_pages",
        cache_block_size=_sels("sglang:page_size"),
        cache_num_blocks=_sels("sglang:num_pages"),
    ),
    EngineMapping(
        "trtllm-serve",
        queued_requests=_sels("trtllm_num_requests_waiting"),
        running_requests=_sels("trtllm_num_requests_running"),
        kv_usage=_sels("trtllm_kv_cache_utilization"),
        cache_block_size=_sels("trtllm_kv_cache_tokens_per_block"),
        cache_num_blocks=_sels("trtllm_kv_cache_max_blocks"),
    ),
    EngineMapping(
        "triton-tensorrt-llm",
        queued_requests=_sels('nv_trt_llm_request_metrics{request_type="waiting"}'),
        running_requests=_sels('nv_trt_llm_request_metrics{request_type="scheduled"}'),
        kv_usage=_sels('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'),
        cache_block_size=_sels('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}'),
        cache_num_blocks=_sels('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}'),
    ),
)
_BUILTIN_BY_NAME = {m.name: m for m in _BUILTINS}
_DEFAULT_ENGINE = "vllm"


def builtin_engines() -> dict[str, EngineMapping]:
    """The built-in mappings by engine name (the values of the engine-type pod label); a new dict each call."""
    return dict(_BUILTIN_BY_NAME)


def engine_for_label(
    value: str | None, engines: Mapping[str, EngineMapping] | None = None, *, default: str = _DEFAULT_ENGINE
) -> tuple[EngineMapping, bool]:
    """The mapping for a pod's engine-type label value, and whether that value was known.

    No label (``None`` or empty) gives the default engine and ``True``: unlabeled pods are the norm.
    An unknown value gives the default engine and ``False``, so the caller can warn once per pod.
    ``engines`` defaults to :func:`builtin_engines`; ``default`` must be one of its keys.
    """
    table = _BUILTIN_BY_NAME if engines is None else engines
    if not value:
        return table[default], True
    mapping = table.get(value)
    if mapping is None:
        return table[default], False
    return mapping, True


# Upstream's engineConfigs keys (core-metrics-extractor) -> EngineMapping fields.
_SELECTOR_KEYS = {
    "queuedRequestsSpec": "queued_requests",
    "runningRequestsSpec": "running_requests",
    "kvUsageSpec": "kv_usage",
    "loraSpec": "lora",
    "cacheInfoSpec": "cache_info",
    "cacheBlockSizeSpec": "cache_block_size",
    "cacheNumBlocksSpec": "cache_num_blocks",
}
_LABEL_KEYS = {
    "cacheBlockSizeLabelName": ("cache_block_size_label", "block_size"),
    "cacheNumBlocksLabelName": ("cache_num_blocks_label", "num_gpu_blocks"),
}
_SINGLE = frozenset({"lora", "cache_info"})


def engine_from_config(
    name: str, overrides: Mapping[str, str | None], base: EngineMapping | None = None
) -> EngineMapping:
    """Build a mapping from one upstream ``engineConfigs`` entry.

    Keys are upstream's: ``queuedRequestsSpec``, ``runningRequestsSpec``, ``kvUsageSpec``,
    ``loraSpec``, ``cacheInfoSpec``, ``cacheBlockSizeSpec``, ``cacheNumBlocksSpec`` (selectors; an
    empty string or ``None`` disables the field) and ``cacheBlockSizeLabelName``,
    ``cacheNumBlocksLabelName`` (label names read from ``cacheInfoSpec``; empty means the default).
    A ``name`` key, if present, must equal ``name``. A selector replaces the field's alternatives.

    ``base=None`` starts from nothing, so fields not given are disabled: upstream's semantics, where
    an entry named like a built-in replaces it entirely. Pass a base to change only some fields.
    Raises :class:`ValueError` naming the engine and the key for unknown keys and bad selectors.
    """
    if not name:
        raise ValueError("engine config name cannot be empty")
    changes: dict[str, object] = {}
    for key, value in overrides.items():
        if key == "name":
            if value != name:
                raise ValueError(f"engine {name!r}: 'name' is {value!r}, expected {name!r}")
            continue
        if key not in _SELECTOR_KEYS and key not in _LABEL_KEYS:
            valid = ", ".join(["name", *_SELECTOR_KEYS, *_LABEL_KEYS])
            raise ValueError(f"engine {name!r}: unknown key {key!r}; valid keys: {valid}")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"engine {name!r}: {key} must be a string, got {type(value).__name__}")
        text = (value or "").strip()
        if key in _SELECTOR_KEYS:
            attr = _SELECTOR_KEYS[key]
            try:
                selector = parse_selector(text) if text else None
            except ValueError as exc:
                raise ValueError(f"engine {name!r}: {key}: {exc}") from None
            changes[attr] = selector if attr in _SINGLE else (() if selector is None else (selector,))
        else:
            attr, default_label = _LABEL_KEYS[key]
            if text and not is_label_name(text):
                raise ValueError(f"engine {name!r}: {key}: invalid label name {text!r}")
            changes[attr] = text or default_label
    # Each value in changes has its field's type (set above, key by key); mypy sees only dict[str, object].
    return replace(base or EngineMapping(name), name=name, **changes)  # type: ignore[arg-type]
