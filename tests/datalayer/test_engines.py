"""The targeted /metrics parser (epp.datalayer.engines): built-in engines, selectors, config, garbage."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

import epp.datalayer.engines
from epp.datalayer.engines import (
    EngineMapping,
    EngineMetrics,
    Selector,
    builtin_engines,
    engine_for_label,
    engine_from_config,
    parse_selector,
)

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


@pytest.fixture(params=["index", "search"], autouse=True)
def page_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs twice: as configured (small pages read by the one-pass index, the rest
    searched), then with every page searched, so that both ways of reading are held to the same tables."""
    if request.param == "search":
        monkeypatch.setattr(epp.datalayer.engines, "_INDEX_MAX_BYTES", -1)
    return str(request.param)


def test_public_api_is_locked() -> None:
    assert epp.datalayer.engines.__all__ == [
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


def _histogram(name: str, labels: str, bounds: list[str]) -> str:
    sep = "," if labels else ""
    lines = [f"# HELP {name} Histogram of {name}.", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels}{sep}le="{b}"}} {i * 3}.0' for i, b in enumerate([*bounds, "+Inf"])]
    lines += [f"{name}_count{{{labels}}} 66.0", f"{name}_sum{{{labels}}} 123.5"]
    return "\n".join(lines) + "\n"


_MODEL = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
_MODEL_B = 'engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"'

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
    f"vllm:num_requests_running{{{_MODEL}}} 7.0\n"
    f"vllm:num_requests_running{{{_MODEL_B}}} 5.0\n"
    """# HELP vllm:num_requests_running_total A distractor after the real one.
# TYPE vllm:num_requests_running_total counter
vllm:num_requests_running_total 99999.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
"""
    f"vllm:num_requests_waiting{{{_MODEL}}} 3.0\n"
    f"vllm:num_requests_waiting{{{_MODEL_B}}} 1.0\n"
    """# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
"""
    f"vllm:gpu_cache_usage_perc{{{_MODEL}}} 0.99\n"
    """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
"""
    f"vllm:kv_cache_usage_perc{{{_MODEL}}} 0.25\n"
    f"vllm:kv_cache_usage_perc{{{_MODEL_B}}} 0.5\n"
    + _histogram("vllm:time_to_first_token_seconds", _MODEL, [str(0.001 * 2**i) for i in range(24)])
    + _histogram("vllm:kv_cache_usage_perc_hist", _MODEL, [str(i / 25) for i in range(1, 25)])
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


def _metrics(
    waiting: int | None = None,
    running: int | None = None,
    kv: float | None = None,
    running_adapters: frozenset[str] = frozenset(),
    waiting_adapters: frozenset[str] = frozenset(),
    max_adapters: int | None = None,
    block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    missing: tuple[str, ...] = (),
) -> EngineMetrics:
    return EngineMetrics(
        waiting, running, kv, running_adapters, waiting_adapters, max_adapters, block_size, num_gpu_blocks, missing
    )


@pytest.mark.parametrize(
    ("mapping", "page", "expected"),
    [
        pytest.param(
            VLLM,
            VLLM_PAGE,
            # Counts summed over engines, KV usage the max; the newest LoRA series (highest value) wins.
            _metrics(4, 12, 0.5, frozenset({"newest", "other"}), frozenset({"w1", "w2"}), 4, 16, 27170),
            id="vllm",
        ),
        pytest.param(SGLANG, SGLANG_OLD_PAGE, _metrics(4, 12, 0.42, block_size=32, num_gpu_blocks=8192), id="sglang"),
        pytest.param(
            SGLANG, SGLANG_NEW_PAGE, _metrics(0, 2, 0.0, block_size=1, num_gpu_blocks=200000), id="sglang-0.5.11"
        ),
        pytest.param(TRTLLM, TRTLLM_PAGE, _metrics(6, 9, 0.125, block_size=32, num_gpu_blocks=19958), id="trtllm"),
        pytest.param(TRITON, TRITON_PAGE, _metrics(5, 16, 0.3, block_size=64, num_gpu_blocks=1000), id="triton"),
    ],
)
def test_engine_pages(mapping: EngineMapping, page: str, expected: EngineMetrics) -> None:
    assert mapping.parse(page.encode()) == expected
    assert mapping.parse(page.replace("\n", "\r\n").encode()) == expected  # CRLF line ends
    assert mapping.parse(page.rstrip("\n").encode()) == expected  # no trailing newline
    # The page's families are what prometheus_client reads too: the hand-made pages are valid.
    assert list(text_string_to_metric_families(page))


def _vllm_gauges(waiting: str = "2.0", running: str = "3.0", kv: str = "0.5", tail: str = "") -> str:
    return (
        f"vllm:num_requests_waiting{{{_MODEL}}} {waiting}\n"
        f"vllm:num_requests_running{{{_MODEL}}} {running}\n"
        f"vllm:kv_cache_usage_perc{{{_MODEL}}} {kv}\n"
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n' + tail
    )


@pytest.mark.parametrize(
    ("page", "waiting", "running", "kv", "missing"),
    [
        pytest.param(_vllm_gauges("1e1", "2.5E+1", "5e-1"), 10, 25, 0.5, (), id="exponents"),
        pytest.param(_vllm_gauges("4 1700000000000", "3 -12", "0.5 1"), 4, 3, 0.5, (), id="timestamps"),
        pytest.param(_vllm_gauges("NaN"), None, 3, 0.5, ("vllm:num_requests_waiting",), id="nan"),
        pytest.param(_vllm_gauges("+Inf", "-Inf"), None, None, 0.5,
                     ("vllm:num_requests_waiting", "vllm:num_requests_running"), id="inf"),
        pytest.param(_vllm_gauges("-1"), None, 3, 0.5, ("vllm:num_requests_waiting",), id="negative"),
        pytest.param(_vllm_gauges("1_000", "abc"), None, None, 0.5,
                     ("vllm:num_requests_waiting", "vllm:num_requests_running"), id="not-numbers"),
        pytest.param(_vllm_gauges("2.6", "1 2 3"), 3, None, 0.5, ("vllm:num_requests_running",), id="round-and-junk"),
        pytest.param(_vllm_gauges("\t7", kv="NaN"), 7, 3, None,
                     ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), id="tab-and-nan-kv"),
    ],
)
def test_values(
    page: str, waiting: int | None, running: int | None, kv: float | None, missing: tuple[str, ...]
) -> None:
    got = VLLM.parse(page.encode())
    assert (got.waiting_queue_size, got.running_requests, got.kv_cache_usage, got.missing) == (
        waiting, running, kv, missing
    )


@pytest.mark.parametrize(
    ("page", "expected_kv", "missing"),
    [
        pytest.param("vllm:gpu_cache_usage_perc 0.75\n", 0.75, (), id="deprecated-name-only"),
        pytest.param("vllm:kv_cache_usage_perc 0.1\nvllm:gpu_cache_usage_perc 0.75\n", 0.1, (), id="new-name-wins"),
        pytest.param("vllm:kv_cache_usage_perc NaN\nvllm:gpu_cache_usage_perc 0.75\n", 0.75, (), id="unusable-new"),
        pytest.param("# vllm:kv_cache_usage_perc 0.1\n", None,
                     ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), id="neither"),
    ],
)
def test_kv_usage_fallback(page: str, expected_kv: float | None, missing: tuple[str, ...]) -> None:
    mapping = EngineMapping("kv", kv_usage=VLLM.kv_usage)
    got = mapping.parse(page.encode())
    assert (got.kv_cache_usage, got.missing) == (expected_kv, missing)


@pytest.mark.parametrize(
    ("lines", "running", "waiting", "max_lora", "missing"),
    [
        pytest.param([], set(), set(), None, (), id="absent-is-not-an-error"),
        pytest.param(['{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 5.0'],
                     set(), set(), 2, (), id="empty-lists"),
        pytest.param(['{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 9.0',
                      '{max_lora="2",running_lora_adapters="b",waiting_lora_adapters="c"} 10.0',
                      '{max_lora="2",running_lora_adapters="d",waiting_lora_adapters=""} 8.0'],
                     {"b"}, {"c"}, 2, (), id="highest-value-in-the-middle"),
        pytest.param(['{running_lora_adapters="a"} 9', '{running_lora_adapters="b"} 10',
                      '{running_lora_adapters="c"} 8'],
                     {"b"}, set(), None, ("vllm:lora_requests_info label max_lora",), id="integers-of-two-lengths"),
        pytest.param(['{running_lora_adapters="a"} 1700000000.25', '{running_lora_adapters="b"} 1700000000.5',
                      '{running_lora_adapters="c"} 1700000000.125'],
                     {"b"}, set(), None, ("vllm:lora_requests_info label max_lora",), id="plain-decimals"),
        pytest.param(['{running_lora_adapters="a"} 1.5e9', '{running_lora_adapters="b"} 1.6e+09',
                      '{running_lora_adapters="c"} 2E8'],
                     {"b"}, set(), None, ("vllm:lora_requests_info label max_lora",), id="exponents"),
        pytest.param(['{running_lora_adapters="a"} 5 1000', '{running_lora_adapters="b"} 6 999'],
                     {"b"}, set(), None, ("vllm:lora_requests_info label max_lora",), id="timestamps"),
        pytest.param(['{running_lora_adapters="a"} 9.9.9', '{running_lora_adapters="b"} 1.0',
                      '{running_lora_adapters="c} 9.5', '{running_lora_adapters="d"} 0.5'],
                     {"b"}, set(), None, ("vllm:lora_requests_info label max_lora",), id="malformed-lines-lose"),
        pytest.param(['{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} NaN',
                      '{max_lora="2",running_lora_adapters="b",waiting_lora_adapters=""} 1.0'],
                     {"b"}, set(), 2, (), id="nan-never-wins"),
        pytest.param(['{running_lora_adapters="a",waiting_lora_adapters="b"} 1.0'],
                     {"a"}, {"b"}, None, ("vllm:lora_requests_info label max_lora",), id="no-max-lora"),
        pytest.param(['{max_lora="x",running_lora_adapters="a"} 1.0'],
                     {"a"}, set(), None, ("vllm:lora_requests_info label max_lora",), id="bad-max-lora"),
        pytest.param(['{max_lora="1",running_lora_adapters="we\\"ird\\\\name,new\\nline",waiting_lora_adapters=""} 1'],
                     {'we"ird\\name', "new\nline"}, set(), 1, (), id="escaped-names"),
        pytest.param(['{max_lora = "3" , running_lora_adapters = "a,b",} 1'],
                     {"a", "b"}, set(), 3, (), id="spaced-pairs-trailing-comma"),
        pytest.param(['{waiting_lora_adapters="x,max_lora=\\"9\\"",max_lora="3"} 1'],
                     set(), {"x", 'max_lora="9"'}, 3, (), id="label-lookalike-inside-value"),
        pytest.param(['{waiting_lora_adapters="},{max_lora=",max_lora="3"} 1'],
                     set(), {"}", "{max_lora="}, 3, (), id="braces-inside-value"),
    ],
)
def test_lora(lines: list[str], running: set[str], waiting: set[str], max_lora: int | None,
              missing: tuple[str, ...]) -> None:
    page = "# TYPE vllm:lora_requests_info gauge\n" + "".join(f"vllm:lora_requests_info{x}\n" for x in lines)
    got = EngineMapping("lora", lora=VLLM.lora).parse(page.encode())
    assert (got.running_adapters, got.waiting_adapters, got.max_adapters, got.missing) == (
        running, waiting, max_lora, missing
    )


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        pytest.param("vllm:num_requests_waiting 3\n", 3, id="first-line"),
        pytest.param("vllm:num_requests_waiting 3", 3, id="only-line-no-newline"),
        pytest.param("x 1\nvllm:num_requests_waiting{a=\"b\"} 3", 3, id="last-line-no-newline"),
        pytest.param("vllm:num_requests_waiting {a=\"b\"} 3\n", 3, id="blank-before-labels"),
        pytest.param("vllm:num_requests_waiting\t3\n", 3, id="tab"),
        pytest.param("vllm:num_requests_waiting{} 3\n", 3, id="empty-label-block"),
        pytest.param("vllm:num_requests_waiting{a=\"1\"} 3\n\n# a comment\nvllm:num_requests_waiting{a=\"2\"} 4\n",
                     7, id="comment-and-blank-line-inside-block"),
        pytest.param("vllm:num_requests_waiting_total 5\nvllm:num_requests_waiting 3\nvllm:num_requests_waiting_x 6",
                     3, id="longer-names-around"),
        pytest.param("vllm:num_requests_waiting{a=\"}\"} 3\n", 3, id="brace-in-value"),
        pytest.param("# HELP vllm:num_requests_waiting 3\n# TYPE vllm:num_requests_waiting gauge\n", None,
                     id="only-in-comments"),
        pytest.param(" vllm:num_requests_waiting 3\n", None, id="indented-is-not-a-sample"),
        pytest.param("vllm:num_requests_waiting{a=\"b} 3\n", None, id="unclosed-label-block"),
        pytest.param("vllm:num_requests_waiting\n", None, id="no-value"),
        pytest.param("xvllm:num_requests_waiting 3\n", None, id="suffix-of-another-name"),
    ],
)
def test_line_shapes(page: str, expected: int | None) -> None:
    mapping = EngineMapping("q", queued_requests=VLLM.queued_requests)
    got = mapping.parse(page.encode())
    assert got.waiting_queue_size == expected
    assert got.missing == (() if expected is not None else ("vllm:num_requests_waiting",))


@pytest.mark.parametrize(
    ("selector", "page", "expected"),
    [
        pytest.param('m{a="x"}', 'm{a="x"} 1\nm{a="y"} 2\nm{b="x"} 4\n', 1, id="equality"),
        pytest.param('m{a=""}', 'm{a="x"} 1\nm{a=""} 2\nm{b="x"} 4\n', 6, id="empty-matches-absent"),
        pytest.param('m{a="q\\"t",b="c,d"}', 'm{b="c,d",a="q\\"t"} 1\nm{a="q\\"t",b="c"} 2\n', 1,
                     id="escaped-quote-and-comma"),
        pytest.param('m{a="back\\\\slash"}', 'm{a="back\\\\slash"} 3\nm{a="backslash"} 4\n', 3, id="backslash"),
        pytest.param('m{a="x"}', 'm{b="a=\\"x\\"",a="y"} 1\nm{b="a=\\"x\\""} 2\n', None, id="lookalike-in-value"),
        pytest.param('m{a="x"}', 'm{b="a=",a="x"} 5\n', 5, id="lookalike-prefix-no-escapes"),
        pytest.param("m{a=x}", 'm{a="x"} 5\n', 5, id="unquoted"),
    ],
)
def test_label_matchers(selector: str, page: str, expected: int | None) -> None:
    mapping = engine_from_config("custom", {"queuedRequestsSpec": selector})
    assert mapping.parse(page.encode()).waiting_queue_size == expected


def test_cache_info_labels() -> None:
    page = b'vllm:cache_config_info{block_size="None",num_gpu_blocks="123"} 1\n'
    got = EngineMapping("c", cache_info=VLLM.cache_info).parse(page)
    assert (got.block_size, got.num_gpu_blocks) == (None, 123)
    assert got.missing == ("vllm:cache_config_info label block_size",)
    custom = engine_from_config(
        "c", {"cacheInfoSpec": "x_info", "cacheBlockSizeLabelName": "bs", "cacheNumBlocksLabelName": "nb"}
    )
    got = custom.parse(b'x_info{nb="7",bs="8"} 1\n')
    assert (got.block_size, got.num_gpu_blocks, got.missing) == (8, 7, ())


GARBAGE = [
    pytest.param(b"", id="empty"),
    pytest.param(b"\n\n\r\n", id="blank"),
    pytest.param(b"<html><head><title>502 Bad Gateway</title></head><body><h1>502</h1></body></html>", id="html"),
    pytest.param(b'{"error": "vllm:num_requests_waiting 3"}', id="json"),
    pytest.param(b"\x00\xff" * 1000, id="binary"),
    pytest.param(b"vllm:num_requests_waiting", id="name-only"),
    pytest.param(b"vllm:num_requests_waiting{", id="open-brace"),
    pytest.param(b'vllm:num_requests_waiting{a="\\', id="dangling-escape"),
    pytest.param(b"\nvllm:cache_config_info{block_size=\"16", id="truncated-info"),
    pytest.param(bytes(random.Random(1).randrange(256) for _ in range(60_000)), id="random"),
    pytest.param(b"vllm:num_requests_waiting 3\xff\xfe\n\xc3(", id="invalid-utf8"),
]


@pytest.mark.parametrize("page", GARBAGE)
def test_garbage_reports_everything_missing(page: bytes) -> None:
    got = VLLM.parse(page)
    assert got == _metrics(missing=ALL_VLLM_MISSING)
    for mapping in builtin_engines().values():
        got = mapping.parse(page)
        assert got.waiting_queue_size is None and got.running_requests is None and got.kv_cache_usage is None
        assert got.missing


def test_truncated_and_mutated_pages_never_raise() -> None:
    page = _big_vllm_page(random.Random(3))
    for cut in range(0, len(page), 97):
        for mapping in builtin_engines().values():
            mapping.parse(page[:cut])
    rng = random.Random(4)
    specials = b'{}"\\,=\n\r \t#_'
    for _ in range(300):
        mutated = bytearray(page)
        for _ in range(rng.randrange(1, 50)):
            mutated[rng.randrange(len(mutated))] = rng.choice(specials) if rng.random() < 0.7 else rng.randrange(256)
        VLLM.parse(bytes(mutated))
    # Lines the regex-free path and the exact path must both survive.
    broken = (b'vllm:lora_requests_info{max_lora="1\\', b'vllm:lora_requests_info{x="\\"} 1',
              b"vllm:lora_requests_info{}}} 1")
    for line in broken:
        assert VLLM.parse(line).max_adapters is None


def test_bytes_like_pages() -> None:
    page = VLLM_PAGE.encode()
    expected = VLLM.parse(page)
    assert VLLM.parse(bytearray(page)) == expected
    assert VLLM.parse(memoryview(page)) == expected  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------- a realistic page


def _big_vllm_page(rng: random.Random, lora: bool = True) -> bytes:
    """A ~55 KB vLLM-like page: process and HTTP metrics, two engines, 14 histograms of ~25 buckets."""
    out = [
        "# HELP python_info Python platform information\n# TYPE python_info gauge\n",
        'python_info{implementation="CPython",major="3",minor="12",patchlevel="3",version="3.12.3"} 1.0\n',
    ]
    for name in ("virtual_memory_bytes", "resident_memory_bytes", "start_time_seconds", "cpu_seconds_total",
                 "open_fds", "max_fds"):
        out.append(f"# HELP process_{name} Process {name}.\n# TYPE process_{name} gauge\n")
        out.append(f"process_{name} {rng.random() * 1e9:.6e}\n")
    for handler in ("/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/tokenize"):
        labels = f'handler="{handler}",method="POST"'
        out.append(_histogram("http_request_duration_seconds", labels, ["0.1", "0.5", "1.0"]))
    out.append(_histogram("http_request_duration_highr_seconds", "", [str(0.01 * 1.5**i) for i in range(21)]))
    gauges = {"vllm:num_requests_running": (4, 9), "vllm:num_requests_waiting": (0, 3),
              "vllm:gpu_cache_usage_perc": (0.5, 0.625), "vllm:kv_cache_usage_perc": (0.5, 0.625)}
    for name, (a, b) in gauges.items():
        out.append(f"# HELP {name} Gauge {name}.\n# TYPE {name} gauge\n")
        out.append(f"{name}{{{_MODEL}}} {float(a)!r}\n{name}{{{_MODEL_B}}} {float(b)!r}\n")
    for counter in ("num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
                    "prefix_cache_hits"):
        out.append(f"# HELP vllm:{counter}_total Counter.\n# TYPE vllm:{counter}_total counter\n")
        out.append(f"vllm:{counter}_total{{{_MODEL}}} {rng.randrange(10**9)}.0\n")
        out.append(f"# HELP vllm:{counter}_created Counter.\n# TYPE vllm:{counter}_created gauge\n")
        out.append(f"vllm:{counter}_created{{{_MODEL}}} 1.7000000123e+09\n")
    latency = [str(x) for x in (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0, 15360.0, 30720.0, 61440.0)]
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "iteration_tokens_total", "request_params_max_tokens", "request_max_num_generation_tokens",
                 "time_per_output_token_seconds", "request_time_per_output_token_seconds"):
        out.append(_histogram(f"vllm:{hist}", _MODEL, latency))
    if lora:
        out.append("# HELP vllm:lora_requests_info Running stats on lora requests.\n"
                   "# TYPE vllm:lora_requests_info gauge\n")
        for i in range(16):
            ts = 1.7e9 + (i * 7919) % 16  # shuffled: 7919 % 16 == 15, so i=1 is the newest
            out.append(f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="a{i}",'
                       f'waiting_lora_adapters="w{i}"}} {ts!r}\n')
    out.append('# HELP vllm:cache_config_info Info.\n# TYPE vllm:cache_config_info gauge\n'
               'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",gpu_memory_utilization="0.9",'
               'num_cpu_blocks="None",num_gpu_blocks="16384",prefix_caching_hash_algo="sha256"} 1.0\n')
    return "".join(out).encode()


def _reference(page: bytes) -> EngineMetrics:
    """What prometheus_client's general parser makes of the same page, with the same rules."""
    fams = {f.name: f for f in text_string_to_metric_families(page.decode())}

    def values(name: str) -> list[float]:
        return [s.value for s in fams[name].samples if s.name == name] if name in fams else []

    lora = [s for s in fams["vllm:lora_requests_info"].samples] if "vllm:lora_requests_info" in fams else []
    newest = max(lora, key=lambda s: s.value).labels if lora else {}
    info = fams["vllm:cache_config_info"].samples[0].labels
    return _metrics(
        round(sum(values("vllm:num_requests_waiting"))),
        round(sum(values("vllm:num_requests_running"))),
        max(values("vllm:kv_cache_usage_perc")),
        frozenset(filter(None, newest.get("running_lora_adapters", "").split(","))),
        frozenset(filter(None, newest.get("waiting_lora_adapters", "").split(","))),
        int(newest["max_lora"]) if newest else None,
        int(info["block_size"]),
        int(info["num_gpu_blocks"]),
    )


@pytest.mark.parametrize("lora", [True, False])
def test_realistic_page_matches_the_general_parser(lora: bool) -> None:
    page = _big_vllm_page(random.Random(7), lora=lora)
    assert 50_000 < len(page) < 60_000
    got = VLLM.parse(page)
    assert got == _reference(page)
    assert (got.waiting_queue_size, got.running_requests, got.kv_cache_usage) == (3, 13, 0.625)
    if lora:
        assert got.running_adapters == {"a1"} and got.waiting_adapters == {"w1"} and got.max_adapters == 2


def test_simulated_vllm_page() -> None:
    from epp.sim.config import EngineConfig
    from epp.sim.engine import Engine
    from epp.sim.metrics import HttpStats, MetricsPage

    engine = Engine(EngineConfig(lora_adapters=("sql-lora",), max_loras=2, num_gpu_blocks=20000, block_size=32))
    got = VLLM.parse(MetricsPage(engine, HttpStats()).render())
    assert got == _metrics(0, 0, 0.0, max_adapters=2, block_size=32, num_gpu_blocks=20000)


def test_blocks_longer_than_the_search_window() -> None:
    # running is searched near waiting, found first; its block (~14 KB) reaches past the window.
    mapping = EngineMapping("t", queued_requests=VLLM.queued_requests, running_requests=VLLM.running_requests)
    running = "".join(f'vllm:num_requests_running{{i="{i}"}} 1\n' for i in range(400))
    before = running + "# HELP x x\n# TYPE x gauge\nx 1\nvllm:num_requests_waiting 2\n"
    after = "vllm:num_requests_waiting 2\n# TYPE vllm:num_requests_running gauge\n" + running
    for page in (before, after):
        assert mapping.parse(page.encode()) == _metrics(2, 400)


def _mutated_pages(rng: random.Random, count: int) -> list[bytes]:
    """Hand-made pages with lines duplicated, moved, dropped, damaged, and comments or blanks slipped in."""
    bases = [p.encode() for p in (VLLM_PAGE, SGLANG_OLD_PAGE, SGLANG_NEW_PAGE, TRTLLM_PAGE, TRITON_PAGE)]
    extra = [b"# HELP x y", b"# TYPE x gauge", b"# a comment", b"", b"\r", b"x 1", b"  vllm:num_requests_waiting 9"]
    pages = []
    for _ in range(count):
        lines = rng.choice(bases).split(b"\n")
        for _ in range(rng.randrange(4)):
            i = rng.randrange(len(lines))
            op = rng.randrange(6)
            if op == 0:
                lines.insert(rng.randrange(len(lines) + 1), lines[i])
            elif op == 1:
                lines.insert(rng.randrange(len(lines) + 1), rng.choice(extra))
            elif op == 2 and len(lines) > 1:
                del lines[i]
            elif op == 3:
                lines.insert(rng.randrange(len(lines)), lines.pop(i))
            elif op == 4 and lines[i]:
                damaged = bytearray(lines[i])
                damaged[rng.randrange(len(damaged))] = rng.choice(b'{}"\\,=\r \t#_0.9eE-')
                lines[i] = bytes(damaged)
            else:
                lines[i] += b"\r"
        pages.append(b"\n".join(lines))
    return pages


def test_the_one_pass_index_reads_what_the_search_reads() -> None:
    # The index is a shortcut for small pages; the search is the reference. Wherever the index takes
    # a page (each metric's lines in one run), both must read the same; elsewhere the search reads it.
    from epp.datalayer.engines import _index, _Scan

    indexed = refused = 0
    for page in _mutated_pages(random.Random(5), 1500):
        for mapping in builtin_engines().values():
            index = _index(mapping._sample_runs, page)  # type: ignore[arg-type]
            searched = mapping._extract(_Scan(page))
            if index is None:
                refused += 1
                assert mapping.parse(page) == searched
            else:
                indexed += 1
                assert mapping._extract(_Scan(page, index)) == searched, page
    assert indexed > 3000 and refused > 100  # both paths were taken


def test_a_metric_whose_lines_are_not_one_run_is_left_to_the_search() -> None:
    from epp.datalayer.engines import _index

    page = b"vllm:num_requests_waiting 1\nx 1\nvllm:num_requests_waiting 2\n"
    assert _index(VLLM._sample_runs, page) is None  # type: ignore[arg-type]
    assert VLLM.parse(page).waiting_queue_size == 2  # the search reads the last block only
    together = b"vllm:num_requests_waiting 1\nvllm:num_requests_waiting 2\nx 1\n"
    run = b" 1\nvllm:num_requests_waiting 2"  # the first line's rest, then whole lines
    assert _index(VLLM._sample_runs, together) == {b"vllm:num_requests_waiting": run}  # type: ignore[arg-type]
    assert VLLM.parse(together).waiting_queue_size == 3


def test_remembered_readings_belong_to_their_selector_and_labels() -> None:
    # cache_config_info and LoRA label readings are remembered by their bytes: the same line read
    # through another selector or other label names must not get another mapping's reading.
    page = b'x_info{a="1",b="2"} 1\nlora{max_lora="3",running_lora_adapters="r",waiting_lora_adapters=""} 5\n'
    one = engine_from_config("one", {"cacheInfoSpec": "x_info", "cacheBlockSizeLabelName": "a",
                                     "cacheNumBlocksLabelName": "b", "loraSpec": "lora"})
    two = engine_from_config("two", {"cacheInfoSpec": "x_info", "cacheBlockSizeLabelName": "b",
                                     "cacheNumBlocksLabelName": "a"})
    three = engine_from_config("three", {"cacheInfoSpec": 'x_info{a="9"}'})
    for _ in range(2):  # the second time from memory
        first, second, third = one.parse(page), two.parse(page), three.parse(page)
        assert (first.block_size, first.num_gpu_blocks, first.running_adapters, first.max_adapters) == (1, 2, {"r"}, 3)
        assert (second.block_size, second.num_gpu_blocks, second.max_adapters) == (2, 1, None)
        assert (third.block_size, third.missing) == (None, ('x_info{a="9"}',))


# --------------------------------------------------------------------------------------- selectors, config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm:num_requests_waiting", Selector("vllm:num_requests_waiting")),
        ("  name  ", Selector("name")),
        ("name{}", Selector("name")),
        ('name{a="b"}', Selector("name", (("a", "b"),))),
        ("name{a=b, c = d}", Selector("name", (("a", "b"), ("c", "d")))),
        ('name { a = "x,y" , }', Selector("name", (("a", "x,y"),))),
        ('name{a="q\\"u\\\\o\\nte"}', Selector("name", (("a", 'q"u\\o\nte'),))),
        ('nv_trt_llm_request_metrics{request_type=waiting}',
         Selector("nv_trt_llm_request_metrics", (("request_type", "waiting"),))),
    ],
)
def test_parse_selector(text: str, expected: Selector) -> None:
    assert parse_selector(text) == expected
    assert parse_selector(str(expected)) == expected  # str() is a canonical round trip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty metric selector"),
        ("   ", "empty metric selector"),
        ("1abc", "invalid metric name"),
        ("a-b", "invalid metric name"),
        ("{a=\"b\"}", "invalid metric name ''"),
        ("name}", "invalid metric name"),
        ("name{", "unclosed '{'"),
        ('name{a="b"', "unclosed '{'"),
        ('name{a="b}', "unterminated quoted label value"),
        ('name{a!="b"}', "only equality matchers"),
        ('name{a=~"b.*"}', "only equality matchers"),
        ("name{a}", 'expected label="value"'),
        ("name{=b}", 'expected label="value"'),
        ("name{a=}", "missing label value"),
        ('name{a="b" c="d"}', "expected ',' or '}'"),
        ('name{a="b",a="c"}', "label 'a' given twice"),
        ('name{1a="b"}', "invalid label name '1a'"),
        ('name{a="b"} extra', "unexpected text"),
        ('name{a="\\x"}', "invalid escape"),
    ],
)
def test_parse_selector_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_selector(text)
    assert message in str(info.value)


def test_engine_from_config_full_replacement_and_merge() -> None:
    # base=None: upstream semantics, fields not given are disabled (None, never reported missing).
    only_queue = engine_from_config("vllm", {"name": "vllm", "queuedRequestsSpec": "vllm:num_requests_waiting"})
    got = only_queue.parse(b"garbage")
    assert got == _metrics(missing=("vllm:num_requests_waiting",))
    # With a base, an empty selector disables one field and keeps the others.
    no_lora_no_kv = engine_from_config("vllm", {"loraSpec": "", "kvUsageSpec": None}, VLLM)
    assert no_lora_no_kv.lora is None and no_lora_no_kv.kv_usage == ()
    assert no_lora_no_kv.queued_requests == VLLM.queued_requests
    got = no_lora_no_kv.parse(VLLM_PAGE.encode())
    assert got.kv_cache_usage is None and got.running_adapters == frozenset() and got.max_adapters is None
    assert got.waiting_queue_size == 4 and got.missing == ()
    disabled = engine_from_config("x", {"queuedRequestsSpec": " "}, VLLM)
    assert disabled.parse(b"").missing == ALL_VLLM_MISSING[1:]
    # A selector replaces the alternatives, and the result equals an explicit construction.
    kv = engine_from_config("vllm", {"kvUsageSpec": "vllm:gpu_cache_usage_perc"}, VLLM)
    assert kv == EngineMapping(**{**{f: getattr(VLLM, f) for f in (
        "name", "queued_requests", "running_requests", "lora", "cache_info")},
        "kv_usage": (Selector("vllm:gpu_cache_usage_perc"),)})
    assert kv.parse(VLLM_PAGE.encode()).kv_cache_usage == 0.99


def test_mappings_and_selectors_check_their_parts() -> None:
    with pytest.raises(ValueError, match="invalid metric name"):
        Selector("not a name")
    with pytest.raises(ValueError, match="invalid label name"):
        Selector("m", (("a-b", "x"),))
    with pytest.raises(TypeError, match="expected a tuple of Selector"):
        EngineMapping("e", queued_requests="vllm:num_requests_waiting")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a Selector or None"):
        EngineMapping("e", lora="vllm:lora_requests_info")  # type: ignore[arg-type]
    assert repr(Selector("m", (("a", 'x"y'),))) == """Selector('m{a="x\\\\"y"}')"""


def test_engine_from_config_all_keys() -> None:
    mapping = engine_from_config(
        "my-engine",
        {
            "queuedRequestsSpec": 'q{status="waiting"}',
            "runningRequestsSpec": "r",
            "kvUsageSpec": "kv",
            "loraSpec": "lora_info",
            "cacheInfoSpec": "info",
            "cacheBlockSizeLabelName": "bs",
            "cacheNumBlocksLabelName": "",
            "cacheBlockSizeSpec": "bs_gauge",
            "cacheNumBlocksSpec": "nb_gauge",
        },
    )
    assert mapping.name == "my-engine"
    assert mapping.cache_block_size_label == "bs" and mapping.cache_num_blocks_label == "num_gpu_blocks"
    page = (
        b'q{status="waiting"} 2\nq{status="done"} 50\nr 1\nkv 0.5\nlora_info{max_lora="1"} 3\n'
        b'info{bs="4"} 1\nnb_gauge 99\n'
    )
    assert mapping.parse(page) == _metrics(2, 1, 0.5, max_adapters=1, block_size=4, num_gpu_blocks=99)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"queuedRequestSpec": "x"}, "unknown key 'queuedRequestSpec'; valid keys: name, queuedRequestsSpec"),
        ({"customMetrics": []}, "unknown key 'customMetrics'"),
        ({"kvUsageSpec": "a{b!=c}"}, "engine 'e': kvUsageSpec: only equality matchers"),
        ({"loraSpec": "bad name"}, "engine 'e': loraSpec: invalid metric name"),
        ({"cacheBlockSizeLabelName": "bad-label"}, "cacheBlockSizeLabelName: invalid label name"),
        ({"runningRequestsSpec": 3}, "runningRequestsSpec must be a string"),
        ({"name": "other"}, "'name' is 'other', expected 'e'"),
    ],
)
def test_engine_from_config_errors(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        engine_from_config("e", overrides, VLLM)  # type: ignore[arg-type]
    assert message in str(info.value)
    with pytest.raises(ValueError, match="name cannot be empty"):
        engine_from_config("", {})


@pytest.mark.parametrize(
    ("value", "engine", "known"),
    [
        (None, "vllm", True),
        ("", "vllm", True),
        ("vllm", "vllm", True),
        ("sglang", "sglang", True),
        ("trtllm-serve", "trtllm-serve", True),
        ("triton-tensorrt-llm", "triton-tensorrt-llm", True),
        ("VLLM", "vllm", False),
        ("tgi", "vllm", False),
    ],
)
def test_engine_for_label(value: str | None, engine: str, known: bool) -> None:
    mapping, is_known = engine_for_label(value)
    assert (mapping.name, is_known) == (engine, known)


def test_engine_for_label_with_configured_engines() -> None:
    custom = engine_from_config("my-engine", {"queuedRequestsSpec": "q"})
    engines = {**builtin_engines(), "my-engine": custom}
    assert engine_for_label("my-engine", engines) == (custom, True)
    assert engine_for_label("nope", engines, default="my-engine") == (custom, False)
    assert engine_for_label(None, engines, default="sglang") == (SGLANG, True)


def test_builtins_are_upstreams() -> None:
    assert set(builtin_engines()) == {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm"}
    assert builtin_engines() is not builtin_engines()  # callers may add to their copy
    assert [str(s) for s in TRITON.queued_requests] == ['nv_trt_llm_request_metrics{request_type="waiting"}']
    assert hash(VLLM) == hash(engine_from_config("vllm", {}, VLLM))
    assert math.isclose(VLLM.parse(VLLM_PAGE.encode()).kv_cache_usage or 0, 0.5)
