"""The engine tables (epp.datalayer.engines): built-in engines' pages, alternatives, config, pod labels."""

from __future__ import annotations

import math

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
)

from ._pages import (
    ALL_VLLM_MISSING,
    SGLANG,
    SGLANG_NEW_PAGE,
    SGLANG_OLD_PAGE,
    SGLANG_PRIORITY_PAGE,
    TRITON,
    TRITON_PAGE,
    TRTLLM,
    TRTLLM_PAGE,
    VLLM,
    VLLM_PAGE,
    engine_metrics,
)

# Every test runs twice, with each way of reading a page (see conftest.page_reading).
pytestmark = pytest.mark.usefixtures("page_reading")


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


@pytest.mark.parametrize(
    ("mapping", "page", "expected"),
    [
        pytest.param(
            VLLM,
            VLLM_PAGE,
            # Counts summed over engines, KV usage the max; the newest LoRA series (highest value) wins.
            engine_metrics(4, 12, 0.5, frozenset({"newest", "other"}), frozenset({"w1", "w2"}), 4, 16, 27170),
            id="vllm",
        ),
        pytest.param(
            SGLANG, SGLANG_OLD_PAGE, engine_metrics(4, 12, 0.42, block_size=32, num_gpu_blocks=8192), id="sglang"
        ),
        pytest.param(
            SGLANG, SGLANG_NEW_PAGE, engine_metrics(0, 2, 0.0, block_size=1, num_gpu_blocks=200000), id="sglang-0.5.11"
        ),
        pytest.param(
            # The per-priority series are not added to the totals (7+2 waiting, 5+1 running, not twice
            # that); geometry from the gauges (0.5.23 has no cache_config_info).
            SGLANG, SGLANG_PRIORITY_PAGE, engine_metrics(9, 6, 0.5, block_size=64, num_gpu_blocks=3000),
            id="sglang-0.5.23-priority",
        ),
        pytest.param(
            TRTLLM, TRTLLM_PAGE, engine_metrics(6, 9, 0.125, block_size=32, num_gpu_blocks=19958), id="trtllm"
        ),
        pytest.param(TRITON, TRITON_PAGE, engine_metrics(5, 16, 0.3, block_size=64, num_gpu_blocks=1000), id="triton"),
    ],
)
def test_engine_pages(mapping: EngineMapping, page: str, expected: EngineMetrics) -> None:
    assert mapping.parse(page.encode()) == expected
    assert mapping.parse(page.replace("\n", "\r\n").encode()) == expected  # CRLF line ends
    assert mapping.parse(page.rstrip("\n").encode()) == expected  # no trailing newline
    # The page's families are what prometheus_client reads too: the hand-made pages are valid.
    assert list(text_string_to_metric_families(page))


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


def test_simulated_vllm_page() -> None:
    from epp.sim.config import EngineConfig
    from epp.sim.engine import Engine
    from epp.sim.metrics import HttpStats, MetricsPage

    engine = Engine(EngineConfig(lora_adapters=("sql-lora",), max_loras=2, num_gpu_blocks=20000, block_size=32))
    got = VLLM.parse(MetricsPage(engine, HttpStats()).render())
    # An engine that has run no step shows vllm:lora_requests_info without a sample, as vLLM 0.32 does
    # (seen on a real server started with --enable-lora): max_lora is unknown until the first step.
    assert got == engine_metrics(
        0, 0, 0.0, max_adapters=None, block_size=32, num_gpu_blocks=20000, kv_cache_size_tokens=20000 * 32
    )
    engine.lora_info.touch("", "")  # what the engine records at each step
    engine.version += 1
    got = VLLM.parse(MetricsPage(engine, HttpStats()).render())
    assert got == engine_metrics(
        0, 0, 0.0, max_adapters=2, block_size=32, num_gpu_blocks=20000, kv_cache_size_tokens=20000 * 32
    )


def test_engine_from_config_full_replacement_and_merge() -> None:
    # base=None: upstream semantics, fields not given are disabled (None, never reported missing).
    only_queue = engine_from_config("vllm", {"name": "vllm", "queuedRequestsSpec": "vllm:num_requests_waiting"})
    got = only_queue.parse(b"garbage")
    assert got == engine_metrics(missing=("vllm:num_requests_waiting",))
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
        "name", "queued_requests", "running_requests", "lora", "cache_info", "filter_path")},
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
    assert mapping.parse(page) == engine_metrics(2, 1, 0.5, max_adapters=1, block_size=4, num_gpu_blocks=99)


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


# vLLM 0.32's cache_config_info carries ~36 labels, among them block_size (128 on CPU), num_gpu_blocks and
# kv_cache_size_tokens, its profiled capacity (issue 13).
_VLLM_032_CACHE_INFO = (
    b"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    b"# TYPE vllm:cache_config_info gauge\n"
    b'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
    b'engine="0",gpu_memory_utilization="0.9",kv_cache_size_tokens="%s",num_gpu_blocks="23",'
    b'prefix_caching_hash_algo="sha256"} 1.0\n'
)


@pytest.mark.parametrize(("size_label", "size_tokens"), [(b"2944", 2944), (b"", None), (b"many", None)])
def test_vllm_cache_size_in_tokens_is_read_when_present(size_label: bytes, size_tokens: int | None) -> None:
    got = VLLM.parse(_VLLM_032_CACHE_INFO % size_label)
    assert (got.block_size, got.num_gpu_blocks, got.kv_cache_size_tokens) == (128, 23, size_tokens)
    assert not [m for m in got.missing if "cache_config_info" in m]  # the label is optional


def test_a_page_without_the_cache_size_label_misses_nothing_for_it() -> None:
    page = _VLLM_032_CACHE_INFO.replace(b'kv_cache_size_tokens="%s",', b"")
    got = VLLM.parse(page)
    assert (got.block_size, got.num_gpu_blocks, got.kv_cache_size_tokens) == (128, 23, None)
    assert not [m for m in got.missing if "cache_config_info" in m]


def test_vllm_waiting_by_reason_is_not_read_as_the_queue() -> None:
    # vLLM 0.32 also serves vllm:num_requests_waiting_by_reason (capacity + deferred = waiting): a name that
    # starts with the queue's; only vllm:num_requests_waiting itself is the queue.
    page = (
        b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 5.0\n'
        b'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 7.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 12.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    )
    assert VLLM.parse(page).waiting_queue_size == 12

