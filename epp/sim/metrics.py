"""Counters, histograms and the Prometheus text page (``GET /metrics``) of one simulated pod.

The page has what a vLLM v1 server (0.10/0.11 era) serves, under vLLM's names, help texts and bucket
boundaries, so that a scraper written for vLLM reads it unchanged:

* scheduler gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
  (and its deprecated twin ``vllm:gpu_cache_usage_perc``);
* ``vllm:lora_requests_info`` (only when LoRA is enabled): labels ``max_lora``, ``running_lora_adapters``,
  ``waiting_lora_adapters`` (comma-separated), value = wall-clock time of the engine step that last saw that
  label combination. Like vLLM (a prometheus_client gauge that is never cleared) old combinations stay on the
  page; scrapers must take the series with the newest timestamp. The simulator keeps the 16 most recent;
* ``vllm:cache_config_info``: an info-style gauge (value 1) whose labels describe the cache (``block_size``,
  ``num_gpu_blocks``, ...);
* counters in tokens/requests, each with its ``_created`` twin as prometheus_client writes them;
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` count prompt tokens looked up / found
  in the prefix cache at each admission and are exact: they are the ground truth of routing benchmarks;
* request histograms (TTFT, inter-token latency, e2e/queue/inference/prefill/decode time, token counts);
* the HTTP metrics of prometheus-fastapi-instrumentator that vLLM's API server exposes (``/metrics`` itself is
  not counted), and the process/python collectors of prometheus_client (real values of this process).

All durations are *simulated* seconds (wall time divided by the time scale), so a 10x accelerated pod reports
the same latencies as a real-time one. A typical page is 50–60 KB (vLLM serves 30–60 KB).

Rendering is incremental: a histogram re-renders only when it has new observations, the process section at
most once a second, and the whole page is reused while nothing changed; a scrape of an unchanged pod costs a
dictionary lookup, a changed one a join of cached strings.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from epp.sim.engine import Engine

__all__ = ["CONTENT_TYPE", "EngineStats", "Histogram", "HttpStats", "LoraInfoHistory", "MetricsPage"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of the Prometheus text exposition format."""

# Bucket boundaries are vLLM v1's (vllm/v1/metrics): facts that dashboards built for vLLM depend on.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# The HTTP instrumentator's histograms: one with many buckets and no labels, one with few buckets per handler.
_HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0,
                       7.5, 10.0, 30.0, 60.0)
_HTTP_FEW_BUCKETS = (0.1, 0.5, 1.0)

_LORA_HISTORY = 16  # label combinations of vllm:lora_requests_info kept on the page
_PROCESS_REFRESH_S = 1.0  # process/python metrics change slowly; recompute at most this often
_DEPRECATED = "DEPRECATED: Use {} instead."  # vLLM appends this, without a space, to deprecated metrics' help


def _one_two_five(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts (capped at max_model_len)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    # prometheus_client sorts label names; so do we, for identical lines.
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))


def _header(name: str, doc: str, kind: str) -> str:
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class Histogram:
    """A Prometheus histogram of one label set, rendered as prometheus_client renders it.

    :meth:`render` gives a whole family; a family with several label sets is ``head`` + every series'
    :meth:`samples` + ``created_head`` + every series' ``created_line``.
    """

    __slots__ = ("_bounds", "_counts", "_prefixes", "_tail_count", "_tail_sum", "_cache", "_cache_count", "head",
                 "created_head", "created_line", "sum", "count")

    def __init__(self, name: str, doc: str, bounds: Sequence[float], labels: dict[str, str], created: float) -> None:
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last slot is +Inf
        les = [repr(b) for b in self._bounds] + ["+Inf"]  # integral bounds print as "1.0", like prometheus_client
        self._prefixes = [f"{name}_bucket{{{_labels(le=le, **labels)}}} " for le in les]
        base = f"{{{_labels(**labels)}}}" if labels else ""
        self._tail_count = f"{name}_count{base} "
        self._tail_sum = f"{name}_sum{base} "
        self._cache = ""
        self._cache_count = -1
        self.head = _header(name, doc, "histogram")
        self.created_head = _header(f"{name}_created", doc, "gauge")
        self.created_line = f"{name}_created{base} {created!r}\n"
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value``."""
        self._counts[bisect_left(self._bounds, value)] += n
        self.sum += value * n
        self.count += n

    def bucket_counts(self) -> list[int]:
        """Cumulative counts per bucket, +Inf last (what the ``_bucket`` lines show)."""
        out, cum = [], 0
        for c in self._counts:
            cum += c
            out.append(cum)
        return out

    def samples(self) -> str:
        """The ``_bucket``, ``_count`` and ``_sum`` lines (cached until the next observation)."""
        if self._cache_count != self.count:
            parts = [f"{p}{c}.0\n" for p, c in zip(self._prefixes, self.bucket_counts())]
            parts.append(f"{self._tail_count}{self.count}.0\n{self._tail_sum}{float(self.sum)!r}\n")
            self._cache = "".join(parts)
            self._cache_count = self.count
        return self._cache

    def render(self) -> str:
        """The exposition text of this histogram as a family of its own."""
        return f"{self.head}{self.samples()}{self.created_head}{self.created_line}"


class EngineStats:
    """Counters and histograms the engine updates; read them freely in tests (they are plain numbers)."""

    FINISH_REASONS = ("stop", "length", "abort")
    """vLLM's FinishReason values, the ``finished_reason`` label of ``vllm:request_success_total``."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        created = time.time()
        labels = {"engine": "0", "model_name": model_name}
        tokens = _one_two_five(max_model_len)

        def hist(name: str, doc: str, bounds: Sequence[float]) -> Histogram:
            return Histogram(name, doc, bounds, labels, created)

        self.created = created
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preemptions = 0
        self.request_success = dict.fromkeys(self.FINISH_REASONS, 0)
        itl_doc = "Histogram of inter-token latency in seconds."
        phase_doc = "Histogram of time spent in {} phase for request."
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     _ITERATION_TOKENS_BUCKETS)
        self.max_generation_len = hist("vllm:request_max_num_generation_tokens",
                                       "Histogram of maximum number of requested generation tokens.", tokens)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.", _PARAMS_N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         _TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."
                         + _DEPRECATED.format("vllm:inter_token_latency_seconds"), _ITL_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", itl_doc, _ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        _REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", phase_doc.format("WAITING"), _REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", phase_doc.format("RUNNING"),
                              _REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", phase_doc.format("PREFILL"), _REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", phase_doc.format("DECODE"), _REQUEST_LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_len = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.histograms = [
            self.iteration_tokens, self.max_generation_len, self.params_n, self.params_max_tokens, self.ttft,
            self.tpot, self.itl, self.request_tpot, self.e2e, self.queue, self.inference, self.prefill, self.decode,
            self.prompt_len, self.generation_len,
        ]
        """Every histogram, in page order."""


class _HandlerStats:
    __slots__ = ("status", "requests", "request_bytes", "response_bytes", "duration")

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
            (_labels(handler=handler, method=method, status=klass), n)
            for (handler, method), h in items
            for klass, n in sorted(h.status.items())
        ]
        out = [_header("http_requests_total", doc, "counter")]
        out += [f"http_requests_total{{{lab}}} {n}.0\n" for lab, n in status_labels]
        out.append(_header("http_requests_created", doc, "gauge"))
        out += [f"http_requests_created{{{lab}}} {created}\n" for lab, _ in status_labels]
        size_doc = ("Content length of {} by handler. Only value of header is respected. Otherwise ignored. "
                    "No percentile calculated. ")
        for metric, what, total in (("http_request_size_bytes", "incoming requests", attrgetter("request_bytes")),
                                    ("http_response_size_bytes", "outgoing responses", attrgetter("response_bytes"))):
            out.append(_header(metric, size_doc.format(what), "summary"))
            for (handler, _), h in items:
                lab = _labels(handler=handler)
                out.append(f"{metric}_count{{{lab}}} {h.requests}.0\n{metric}_sum{{{lab}}} {total(h)}.0\n")
            out.append(_header(f"{metric}_created", size_doc.format(what), "gauge"))
            out += [f"{metric}_created{{{_labels(handler=handler)}}} {created}\n" for (handler, _), _h in items]
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
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    ("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of queried tokens."
     + _DEPRECATED.format("vllm:prefix_cache_queries"), "prefix_cache_queries"),
    ("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached tokens."
     + _DEPRECATED.format("vllm:prefix_cache_hits"), "prefix_cache_hits"),
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
)


class MetricsPage:
    """Renders the ``/metrics`` page of one pod from its engine and HTTP statistics."""

    def __init__(self, engine: Engine, http: HttpStats) -> None:
        self._engine = engine
        self._http = http
        cfg = engine.config
        base_labels = {"engine": "0", "model_name": cfg.model}
        base = _labels(**base_labels)
        created = repr(engine.stats.created)

        def gauge(name: str, doc: str) -> str:
            return _header(name, doc, "gauge") + f"{name}{{{base}}} "

        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self._gpu_usage = gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
                                + _DEPRECATED.format("vllm:kv_cache_usage_perc"))
        self._kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._counters = [
            (_header(f"{name}_total", doc, "counter") + f"{name}_total{{{base}}} ",
             attrgetter(attr),
             "\n" + _header(f"{name}_created", doc, "gauge") + f"{name}_created{{{base}}} {created}\n")
            for name, doc, attr in _COUNTERS
        ]
        success_doc = "Count of successfully processed requests."
        success_labels = [_labels(finished_reason=r, **base_labels) for r in EngineStats.FINISH_REASONS]
        self._success_head = _header("vllm:request_success_total", success_doc, "counter")
        self._success_lines = [f"vllm:request_success_total{{{lab}}} " for lab in success_labels]
        self._success_created = _header("vllm:request_success_created", success_doc, "gauge") + "".join(
            f"vllm:request_success_created{{{lab}}} {created}\n" for lab in success_labels
        )
        self._lora_head = _header("vllm:lora_requests_info", "Running stats on lora requests.", "gauge")
        # CacheConfig fields as vLLM lists them; the ones the simulator does not model have vLLM's defaults.
        cache_config = _labels(
            block_size=str(cfg.block_size), cache_dtype="auto", calculate_kv_scales="False", cpu_offload_gb="0",
            enable_prefix_caching="True", engine="0", gpu_memory_utilization="0.9", is_attention_free="False",
            num_cpu_blocks="None", num_gpu_blocks=str(cfg.num_gpu_blocks), num_gpu_blocks_override="None",
            prefix_caching_hash_algo="sha256", sliding_window="None", swap_space="4", swap_space_bytes=str(4 << 30),
        )
        self._cache_config = (_header("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
                              + f"vllm:cache_config_info{{{cache_config}}} 1.0\n")
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
            f"{self._gpu_usage}{usage}\n{self._kv_usage}{usage}\n",
        ]
        for head, value, created in self._counters:
            parts += (head, str(value(stats)), ".0", created)
        parts.append(self._success_head)
        parts += [f"{line}{stats.request_success[r]}.0\n"
                  for line, r in zip(self._success_lines, EngineStats.FINISH_REASONS)]
        parts.append(self._success_created)
        parts += [h.render() for h in stats.histograms]
        if engine.config.lora_enabled:
            parts.append(self._lora_head)
            max_lora = str(engine.config.max_loras)
            for (running, waiting), ts in engine.lora_info.items():
                lab = _labels(max_lora=max_lora, running_lora_adapters=running, waiting_lora_adapters=waiting)
                parts.append(f"vllm:lora_requests_info{{{lab}}} {ts!r}\n")
        parts.append(self._cache_config)
        self._cache = "".join(parts).encode()
        self._cache_key = key
        return self._cache


class LoraInfoHistory(OrderedDict[tuple[str, str], float]):
    """Label combinations of ``vllm:lora_requests_info`` -> wall time last seen, most recent last (bounded)."""

    def touch(self, running: str, waiting: str) -> None:
        """Record that the engine saw these running/waiting adapter lists now."""
        key = (running, waiting)
        self[key] = time.time()
        self.move_to_end(key)
        if len(self) > _LORA_HISTORY:
            self.popitem(last=False)


def restrict_page(page: bytes, names: Iterable[bytes]) -> bytes:
    """``page`` with only the families and samples named in ``names`` (their ``# HELP``/``# TYPE``
    lines kept), as prometheus_client's exposition answers ``/metrics?name[]=a&name[]=b``."""
    wanted = set(names)
    kept = []
    for line in page.split(b"\n"):
        if line.startswith((b"# HELP ", b"# TYPE ")):
            name = line.split(b" ", 3)[2]
        else:
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if line and name in wanted:
            kept.append(line)
    return b"\n".join(kept) + b"\n" if kept else b""
