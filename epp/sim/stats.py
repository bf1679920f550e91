"""What one simulated engine counts: vLLM's counters and request histograms, and the LoRA label history.

The engine (:mod:`epp.sim.engine`) updates these as it runs; the ``/metrics`` page (:mod:`epp.sim.metrics`)
reads them. Names, help texts and bucket boundaries are vLLM 0.32's (vllm/v1/metrics/loggers.py; the
deprecated ``vllm:time_per_output_token_seconds`` and ``vllm:gpu_prefix_cache_*`` it no longer serves are
gone here too), so dashboards and scrapers built for vLLM read the page unchanged. Everything here is
plain numbers that tests may read directly; none of it knows about the engine, which keeps the engine
and the page free of a mutual import.

``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens looked up / found in the prefix cache at
each admission and are exact: they are the ground truth of routing benchmarks. All durations are *simulated*
seconds (wall time divided by the time scale).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from epp.sim.exposition import Histogram

__all__ = ["EngineStats", "LoraInfoHistory"]

# Bucket boundaries are vLLM v1's (vllm/v1/metrics): facts that dashboards built for vLLM depend on.
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)

# vLLM keeps every label combination of vllm:lora_requests_info ever seen; this bound only keeps a
# simulator that runs for days with many adapters from growing without end (no test or bench gets near it).
_LORA_HISTORY = 4096


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
        self.prompt_tokens_cached = 0
        """Prompt tokens found in the prefix cache, per request at its first admission (counted at its first
        token, like ``prompt_tokens``): ``vllm:prompt_tokens_cached`` and ``source="local_cache_hit"``."""
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
            self.itl, self.request_tpot, self.e2e, self.queue, self.inference, self.prefill, self.decode,
            self.prompt_len, self.generation_len,
        ]
        """Every histogram, in page order."""


class LoraInfoHistory(OrderedDict[tuple[str, str], float]):
    """Label combinations of ``vllm:lora_requests_info`` -> wall time last seen, most recent last (bounded).

    Like vLLM (a prometheus_client gauge that is never cleared) every combination seen stays on the page and
    scrapers must take the series with the newest timestamp (the simulator forgets the oldest past 4,096).
    """

    def touch(self, running: str, waiting: str) -> None:
        """Record that the engine saw these running/waiting adapter lists now."""
        key = (running, waiting)
        self[key] = time.time()
        self.move_to_end(key)
        if len(self) > _LORA_HISTORY:
            self.popitem(last=False)
