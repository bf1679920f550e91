"""Sample /metrics pages of each built-in engine, and the readings expected of them (shared by
test_page.py and test_engines.py)."""

from __future__ import annotations

from epp.datalayer.engines import EngineMetrics, builtin_engines

VLLM = builtin_engines()["vllm"]
SGLANG = builtin_engines()["sglang"]
TRTLLM = builtin_engines()["trtllm-serve"]
TRITON = builtin_engines()["triton-tensorrt-llm"]

ALL_VLLM_MISSING = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
)


def histogram(name: str, labels: str, bounds: list[str]) -> str:
    sep = "," if labels else ""
    lines = [f"# HELP {name} Histogram of {name}.", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels}{sep}le="{b}"}} {i * 3}.0' for i, b in enumerate([*bounds, "+Inf"])]
    lines += [f"{name}_count{{{labels}}} 66.0", f"{name}_sum{{{labels}}} 123.5"]
    return "\n".join(lines) + "\n"


MODEL = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
MODEL_B = 'engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"'

# A vLLM page: process metrics first, distractors sharing prefixes with the wanted names (before and
# after them), names inside comments, two engines (data parallel) per gauge, LoRA history, histograms.
VLLM_PAGE = (
    """# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 1234.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
# HELP vllm:num_requests_waiting_by_priority A distractor: a longer name sharing the prefix.
# TYPE vllm:num_requests_waiting_by_priority gauge
vllm:num_requests_waiting_by_priority{priority="0"} 1000.0
# HELP vllm:num_requests_running Number of requests in model execution batches. Not vllm:num_requests_waiting
# TYPE vllm:num_requests_running gauge
"""
    f"vllm:num_requests_running{{{MODEL}}} 7.0\n"
    f"vllm:num_requests_running{{{MODEL_B}}} 5.0\n"
    """# HELP vllm:num_requests_running_total A distractor after the real one.
# TYPE vllm:num_requests_running_total counter
vllm:num_requests_running_total 99999.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
"""
    f"vllm:num_requests_waiting{{{MODEL}}} 3.0\n"
    f"vllm:num_requests_waiting{{{MODEL_B}}} 1.0\n"
    """# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
"""
    f"vllm:gpu_cache_usage_perc{{{MODEL}}} 0.99\n"
    """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
"""
    f"vllm:kv_cache_usage_perc{{{MODEL}}} 0.25\n"
    f"vllm:kv_cache_usage_perc{{{MODEL_B}}} 0.5\n"
    + histogram("vllm:time_to_first_token_seconds", MODEL, [str(0.001 * 2**i) for i in range(24)])
    + histogram("vllm:kv_cache_usage_perc_hist", MODEL, [str(i / 25) for i in range(1, 25)])
    + """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7000000000e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,tweet-lora",waiting_lora_adapters="x"} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="newest, other",waiting_lora_adapters="w1,,w2"} 1.7000001e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="older",waiting_lora_adapters=""} 1.6e9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
"""
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_cpu_blocks="None",'
    'num_gpu_blocks="27170",num_gpu_blocks_override="None",sliding_window="None"} 1.0\n'
)

SGLANG_OLD_PAGE = """# HELP sglang:num_queue_reqs_total A distractor.
# TYPE sglang:num_queue_reqs_total counter
sglang:num_queue_reqs_total{model_name="qwen"} 500.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 4.0
# HELP sglang:full_token_usage The token usage for full attention layers.
# TYPE sglang:full_token_usage gauge
sglang:full_token_usage{model_name="qwen",tp_rank="0"} 0.9
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.42
# HELP sglang:cache_config_info Information of the cache config.
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{model_name="qwen",num_pages="8192",page_size="32"} 1.0
"""

# SGLang 0.5.11 and later: no cache_config_info, two gauges instead.
SGLANG_NEW_PAGE = """# HELP sglang:page_size KV cache page size in tokens.
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 1.0
# HELP sglang:num_pages Number of KV cache pages.
# TYPE sglang:num_pages gauge
sglang:num_pages{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 200000.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 0.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 2.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 0.0
"""

TRTLLM_PAGE = """# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="pytorch",model_name="Qwen/Qwen3-0.6B"} 0.125
# HELP trtllm_kv_cache_max_blocks Maximum number of KV cache blocks
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{engine_type="pytorch",model_name="Qwen/Qwen3-0.6B"} 19958.0
# HELP trtllm_kv_cache_tokens_per_block Number of tokens per KV cache block
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{engine_type="pytorch",model_name="Qwen/Qwen3-0.6B"} 32.0
# HELP trtllm_num_requests_waiting Number of waiting requests
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="pytorch",model_name="Qwen/Qwen3-0.6B"} 6.0
# HELP trtllm_num_requests_running Number of running requests
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="pytorch",model_name="Qwen/Qwen3-0.6B"} 9.0
# HELP trtllm_num_requests_running_max A distractor.
# TYPE trtllm_num_requests_running_max gauge
trtllm_num_requests_running_max 64.0
"""


def _triton_model(model: str, waiting: int, scheduled: int, fraction: float) -> str:
    rows = [
        f'nv_trt_llm_request_metrics{{model="{model}",request_type="context",version="1"}} 1',
        f'nv_trt_llm_request_metrics{{model="{model}",request_type="scheduled",version="1"}} {scheduled}',
        f'nv_trt_llm_request_metrics{{model="{model}",request_type="max",version="1"}} 512',
        f'nv_trt_llm_request_metrics{{model="{model}",request_type="active",version="1"}} {scheduled + waiting}',
        f'nv_trt_llm_request_metrics{{model="{model}",request_type="waiting",version="1"}} {waiting}',
    ]
    return "\n".join(rows) + "\n"


TRITON_PAGE = (
    """# HELP nv_inference_request_success Number of successful inference requests, all batch sizes
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="tensorrt_llm",version="1"} 1234
# HELP nv_trt_llm_request_metrics TRT LLM request metrics
# TYPE nv_trt_llm_request_metrics gauge
"""
    + _triton_model("tensorrt_llm", 3, 10, 0.0)
    + _triton_model("tensorrt_llm_2", 2, 6, 0.0)
    + """# HELP nv_trt_llm_kv_cache_block_metrics TRT LLM KV cache block metrics
# TYPE nv_trt_llm_kv_cache_block_metrics gauge
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="tensorrt_llm",version="1"} 64
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",model="tensorrt_llm",version="1"} 100
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="free",model="tensorrt_llm",version="1"} 900
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm",version="1"} 1000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm",version="1"} 0.1
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm_2",version="1"} 0.3
"""
)


def engine_metrics(
    waiting: int | None = None,
    running: int | None = None,
    kv: float | None = None,
    running_adapters: frozenset[str] = frozenset(),
    waiting_adapters: frozenset[str] = frozenset(),
    max_adapters: int | None = None,
    block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    missing: tuple[str, ...] = (),
    kv_cache_size_tokens: int | None = None,
) -> EngineMetrics:
    return EngineMetrics(
        waiting, running, kv, running_adapters, waiting_adapters, max_adapters, block_size, num_gpu_blocks, missing,
        kv_cache_size_tokens,
    )

# SGLang 0.5.23 with --enable-priority-scheduling, written by hand from its sources
# (sglang/srt/observability/metrics_collector.py): every scheduler gauge carries priority="", and the
# queue and running gauges also have one series per priority seen, so the totals appear twice.
# Two data-parallel ranks: each rank's total counts.
SGLANG_PRIORITY_PAGE = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 5.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="0",tp_rank="0"} 2.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="10",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 1.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="0",tp_rank="0"} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 7.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="0",tp_rank="0"} 4.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="10",tp_rank="0"} 3.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="10",tp_rank="0"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 0.25
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 0.5
# HELP sglang:page_size KV cache page size in tokens.
# TYPE sglang:page_size gauge
sglang:page_size{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 64.0
sglang:page_size{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 64.0
# HELP sglang:num_pages Number of KV cache pages.
# TYPE sglang:num_pages gauge
sglang:num_pages{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 3000.0
sglang:num_pages{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",priority="",tp_rank="0"} 3000.0
"""
