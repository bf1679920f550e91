"""The page reader (epp.datalayer.page): values, line shapes, label matchers, garbage, big pages,
and the one-pass index held to the search's answers."""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

import epp.datalayer.page
from epp.datalayer.engines import EngineMapping, EngineMetrics, builtin_engines, engine_from_config

from ._pages import (
    ALL_VLLM_MISSING,
    MODEL,
    MODEL_B,
    SGLANG_NEW_PAGE,
    SGLANG_OLD_PAGE,
    TRITON_PAGE,
    TRTLLM_PAGE,
    VLLM,
    VLLM_PAGE,
    engine_metrics,
    histogram,
)

# Every test runs twice, with each way of reading a page (see conftest.page_reading).
pytestmark = pytest.mark.usefixtures("page_reading")


def _vllm_gauges(waiting: str = "2.0", running: str = "3.0", kv: str = "0.5", tail: str = "") -> str:
    return (
        f"vllm:num_requests_waiting{{{MODEL}}} {waiting}\n"
        f"vllm:num_requests_running{{{MODEL}}} {running}\n"
        f"vllm:kv_cache_usage_perc{{{MODEL}}} {kv}\n"
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
    assert got == engine_metrics(missing=ALL_VLLM_MISSING)
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
        out.append(histogram("http_request_duration_seconds", labels, ["0.1", "0.5", "1.0"]))
    out.append(histogram("http_request_duration_highr_seconds", "", [str(0.01 * 1.5**i) for i in range(21)]))
    gauges = {"vllm:num_requests_running": (4, 9), "vllm:num_requests_waiting": (0, 3),
              "vllm:gpu_cache_usage_perc": (0.5, 0.625), "vllm:kv_cache_usage_perc": (0.5, 0.625)}
    for name, (a, b) in gauges.items():
        out.append(f"# HELP {name} Gauge {name}.\n# TYPE {name} gauge\n")
        out.append(f"{name}{{{MODEL}}} {float(a)!r}\n{name}{{{MODEL_B}}} {float(b)!r}\n")
    for counter in ("num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
                    "prefix_cache_hits"):
        out.append(f"# HELP vllm:{counter}_total Counter.\n# TYPE vllm:{counter}_total counter\n")
        out.append(f"vllm:{counter}_total{{{MODEL}}} {rng.randrange(10**9)}.0\n")
        out.append(f"# HELP vllm:{counter}_created Counter.\n# TYPE vllm:{counter}_created gauge\n")
        out.append(f"vllm:{counter}_created{{{MODEL}}} 1.7000000123e+09\n")
    latency = [str(x) for x in (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0, 15360.0, 30720.0, 61440.0)]
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "iteration_tokens_total", "request_params_max_tokens", "request_max_num_generation_tokens",
                 "time_per_output_token_seconds", "request_time_per_output_token_seconds"):
        out.append(histogram(f"vllm:{hist}", MODEL, latency))
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
    return engine_metrics(
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


def test_blocks_longer_than_the_search_window() -> None:
    # running is searched near waiting, found first; its block (~14 KB) reaches past the window.
    mapping = EngineMapping("t", queued_requests=VLLM.queued_requests, running_requests=VLLM.running_requests)
    running = "".join(f'vllm:num_requests_running{{i="{i}"}} 1\n' for i in range(400))
    before = running + "# HELP x x\n# TYPE x gauge\nx 1\nvllm:num_requests_waiting 2\n"
    after = "vllm:num_requests_waiting 2\n# TYPE vllm:num_requests_running gauge\n" + running
    for page in (before, after):
        assert mapping.parse(page.encode()) == engine_metrics(2, 400)


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
    from epp.datalayer.page import Page, _index

    indexed = refused = 0
    for page in _mutated_pages(random.Random(5), 1500):
        for mapping in builtin_engines().values():
            index = _index(mapping._sample_runs, page)  # type: ignore[arg-type]
            searched = mapping._extract(Page(page))
            if index is None:
                refused += 1
                assert mapping.parse(page) == searched
            else:
                indexed += 1
                assert mapping._extract(Page(page, index)) == searched, page
    assert indexed > 3000 and refused > 100  # both paths were taken


def test_a_metric_whose_lines_are_not_one_run_is_left_to_the_search() -> None:
    from epp.datalayer.page import _index

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


def test_public_api_is_locked() -> None:
    assert epp.datalayer.page.__all__ == ["CacheInfoLabels", "CompiledSelector", "Page", "read_page", "sample_runs"]


def test_the_index_regex_prefers_the_longest_name(page_reading: str) -> None:
    from epp.datalayer.page import _index, sample_runs

    assert sample_runs([]) is None
    runs = sample_runs(["m", "m_total"])
    assert runs is not None
    # "m" is a prefix of "m_total": each line goes to its own metric, not to the shorter name.
    assert _index(runs, b"m_total 5\nm 1\n") == {b"m_total": b" 5", b"m": b" 1"}


def test_small_pages_are_indexed_and_large_or_ungrouped_ones_searched(page_reading: str) -> None:
    from epp.datalayer.page import read_page, sample_runs

    runs = sample_runs(["vllm:num_requests_waiting"])
    small = b"vllm:num_requests_waiting 1\n"
    large = small + b"# " + b"x" * 20_000 + b"\n"
    ungrouped = b"vllm:num_requests_waiting 1\nx 1\nvllm:num_requests_waiting 2\n"
    indexed = page_reading == "index"  # the search variant turns the index off
    assert (read_page(small, runs).index is not None) is indexed
    assert read_page(large, runs).index is None
    assert read_page(ungrouped, runs).index is None
    assert read_page(small, None).index is None  # nothing wanted: nothing to index
