"""Through a real Envoy and the picker, against two real vLLM 0.32 servers (see conftest.py).

The stopped-server test runs last (it stops server ``b``); the others leave the servers as they
found them. Counters are read from the servers' own metrics pages, so what is asserted is what
vLLM itself saw.
"""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any

import pytest

from epp.testing.vllm import ADAPTER, BASE
from epp.testing.vllm import http_get as get
from epp.testing.vllm import http_post as post
from tests.realvllm.conftest import Tier

_WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
]


def _prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _queries(tier: Tier) -> dict[str, float]:
    return {name: s.counter("vllm:prefix_cache_queries_total") for name, s in tier.servers.items()}


_VARIANTS = ["processed", "observed", "workers"]  # see Tier.route


@pytest.mark.parametrize("variant", _VARIANTS)
def test_json_and_sse_route_through_envoy(tier: Tier, variant: str) -> None:
    url, _ = tier.route(variant)
    status, body = post(f"{url}/v1/completions", {"model": BASE, "prompt": "hello there", "max_tokens": 4})
    assert status == 200, body
    reply = json.loads(body)
    assert reply["model"] == BASE and len(reply["choices"]) == 1 and reply["usage"]["completion_tokens"] >= 1

    chat = {
        "model": BASE,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, body = post(f"{url}/v1/chat/completions", chat)
    assert status == 200, body
    events = [line for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] >= 1


def _sum(page: str, family: str) -> float:
    return sum(
        float(v) for v in re.findall(rf"^{family}_sum\{{[^}}]*model_name=\"{BASE}\"[^}}]*\}} (\S+)$", page, re.M)
    )


def _long_stream(url: str, prompt: str, tokens: int) -> tuple[dict[str, object], list[str], list[dict[str, Any]]]:
    """``tokens`` tokens of a greedy completion streamed with a logprob each, answered 200 and ended by
    ``[DONE]``: its body, its events' data and their choices (the usage event, second to last, has none)."""
    body: dict[str, object] = {
        "model": BASE,
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, reply = post(f"{url}/v1/completions", body)
    assert status == 200, reply
    events = [line[6:] for line in reply.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return body, events, [c for e in events[:-1] for c in json.loads(e)["choices"]]


@pytest.mark.parametrize("variant", _VARIANTS)
def test_a_long_stream_arrives_whole_and_its_usage_reaches_the_pickers_metrics(tier: Tier, variant: str) -> None:
    # 1,500 tokens in some hundreds of SSE events: the middle chunks are answered by the picker's I/O
    # thread (a plaintext port, one stream: the connection is lent to it), the last one carries the usage
    # it reads (epp.wire, epp.extproc.usage). vLLM sends one event a token only while its API process keeps
    # up with the engine; behind it, it merges the tokens made meanwhile into one event (its
    # RequestOutputCollector), so what proves nothing was lost is each token's logprob entry, counted.
    # Observed (epp envoy-config --observe-responses): the same through an Envoy whose second filter
    # sends the picker the response unanswered, its middle chunks read by the I/O thread in batches.
    # Workers: the same through a picker with --workers 2 (a worker's I/O thread; the owner's metrics).
    url, picker = tier.route(variant)
    metrics = f"http://127.0.0.1:{picker.metrics_port}/metrics"
    before = get(metrics)[1].decode()
    made = {name: s.counter("vllm:generation_tokens_total") for name, s in tier.servers.items()}
    body, events, choices = _long_stream(url, _prompt(11, 40), 1500)
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 1500
    assert len(choices) > 100  # enough for the lending rule (--io-thread-after-chunks 32) to lend it
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == 1500  # every token's event came through
    texts = [c["text"] for c in choices]
    plain = {k: v for k, v in body.items() if k != "stream_options"}  # (vLLM refuses it without streaming)
    # Greedy over the same weights gives the same text on the server that streamed it (server a, LoRA on,
    # may break a near tie of these random weights otherwise than b): the one whose generated tokens rose.
    generated = {name: s.counter("vllm:generation_tokens_total") - made[name] for name, s in tier.servers.items()}
    (streamed_by,) = [name for name, n in generated.items() if n >= 1500]
    direct = post(f"{tier.servers[streamed_by].url}/v1/completions", {**plain, "stream": False})
    assert direct[0] == 200, direct
    assert json.loads(direct[1])["choices"][0]["text"] == "".join(texts)
    after = ""
    for _ in range(50):  # the response's end is accounted just after its last chunk went out
        after = get(metrics)[1].decode()
        if _sum(after, "inference_objective_output_tokens") - _sum(before, "inference_objective_output_tokens") >= 1500:
            break
        time.sleep(0.1)
    assert _sum(after, "inference_objective_output_tokens") - _sum(before, "inference_objective_output_tokens") == 1500
    assert (
        _sum(after, "inference_objective_input_tokens") - _sum(before, "inference_objective_input_tokens")
        == (usage["prompt_tokens"])
    )
    pool = json.loads(get(f"http://127.0.0.1:{picker.metrics_port}/debug/pool")[1])["endpoints"]
    assert all(e["in_flight"]["requests"] == 0 for e in pool)


def test_concurrent_long_streams_observed_arrive_whole_and_are_accounted(tier: Tier) -> None:
    # Envoy multiplexes the observer's streams onto few connections; a connection of observed streams
    # only is lent to the I/O thread with more than four of them (epp/wire/_fast.c, LEND_MAX_OPEN). Six
    # long streams at once through the observing Envoy: each arrives whole (every token's logprob entry)
    # and the picker accounts every one's usage and releases every in-flight count.
    from concurrent.futures import ThreadPoolExecutor

    url, picker = tier.route("observed")
    metrics = f"http://127.0.0.1:{picker.metrics_port}/metrics"
    output_before = _sum(get(metrics)[1].decode(), "inference_objective_output_tokens")
    tokens, streams = 800, 6

    def stream(seed: int) -> tuple[int, int]:
        _, events, choices = _long_stream(url, _prompt(100 + seed, 30), tokens)
        return json.loads(events[-2])["usage"]["completion_tokens"], sum(len(c["logprobs"]["tokens"]) for c in choices)

    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(stream, range(streams)))
    assert results == [(tokens, tokens)] * streams
    counted = 0.0
    for _ in range(50):  # each response's end is accounted just after its last chunk went out
        counted = _sum(get(metrics)[1].decode(), "inference_objective_output_tokens") - output_before
        if counted >= tokens * streams:
            break
        time.sleep(0.1)
    assert counted == tokens * streams
    pool_state = json.loads(get(f"http://127.0.0.1:{picker.metrics_port}/debug/pool")[1])["endpoints"]
    assert all(e["in_flight"]["requests"] == 0 for e in pool_state)


def test_real_pages_are_scraped_filtered_and_without_errors(tier: Tier) -> None:
    page = get(f"http://127.0.0.1:{tier.picker.metrics_port}/metrics")[1].decode()
    # Every page read is understood. A timeout is the machine's, not the page's: a CPU server's API process
    # can miss the 1 s bound while its engine generates 1,500 tokens on the same two cores.
    errors = [line for line in page.splitlines() if line.startswith("epp_endpoint_scrape_errors_total{")
              and 'reason="timeout"' not in line]  # fmt: skip
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in errors), errors
    ignored = [line for line in page.splitlines() if line.startswith("epp_endpoint_scrape_filter_ignored_total{")]
    assert all(float(line.rsplit(" ", 1)[1]) == 0 for line in ignored), ignored  # /metrics/ honours ?name[]=
    scrapes = re.search(r"^epp_endpoint_scrapes_total (\S+)", page, re.M)
    assert scrapes and float(scrapes.group(1)) > 0


_USER = [{"role": "user", "content": "hi"}]
# (id, path, body): what the picker reads of a body, in the shapes vLLM 0.32 takes and those it refuses.
_BODIES: list[tuple[str, str, object]] = [
    ("max_tokens-string", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": "3"}),
    ("max_tokens-float", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 3.0}),
    ("max_tokens-null", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": None}),
    ("max_tokens-zero", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 0}),
    ("max_tokens-huge", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 10**9}),
    ("stream-string", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 3, "stream": "false"}),
    ("stream-null", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 3, "stream": None}),
    ("stream-int", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 3, "stream": 1}),
    ("stream_options-without-stream", "/v1/completions",
     {"model": BASE, "prompt": "x", "max_tokens": 3, "stream_options": {"include_usage": True}}),
    ("no-model", "/v1/completions", {"prompt": "x", "max_tokens": 3}),
    ("model-empty", "/v1/completions", {"model": "", "prompt": "x", "max_tokens": 3}),
    ("model-int", "/v1/completions", {"model": 5, "prompt": "x", "max_tokens": 3}),
    ("model-unknown", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 3}),
    ("prompt-token-ids", "/v1/completions", {"model": BASE, "prompt": [1, 2, 3, 4], "max_tokens": 3}),
    ("prompt-token-id-lists", "/v1/completions", {"model": BASE, "prompt": [[1, 2, 3], [4, 5]], "max_tokens": 3}),
    ("prompt-strings", "/v1/completions", {"model": BASE, "prompt": ["a b", "c d"], "max_tokens": 3}),
    ("prompt-empty", "/v1/completions", {"model": BASE, "prompt": "", "max_tokens": 3}),
    ("prompt-null", "/v1/completions", {"model": BASE, "prompt": None, "max_tokens": 3}),
    ("prompt-over-the-context", "/v1/completions", {"model": BASE, "prompt": "hello " * 3000, "max_tokens": 3}),
    ("truncate_prompt_tokens", "/v1/completions",
     {"model": BASE, "prompt": "hello " * 100, "max_tokens": 3, "truncate_prompt_tokens": 10}),
    ("unknown-field", "/v1/completions", {"model": BASE, "prompt": "x", "max_tokens": 3, "frobnicate": {"x": 1}}),
    ("body-array", "/v1/completions", [1, 2]),
    ("body-string", "/v1/completions", "hi"),
    ("body-null", "/v1/completions", None),
    ("chat-content-parts", "/v1/chat/completions",
     {"model": BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3}),
    ("chat-no-messages", "/v1/chat/completions", {"model": BASE, "messages": [], "max_tokens": 3}),
    ("chat-messages-object", "/v1/chat/completions", {"model": BASE, "messages": _USER[0], "max_tokens": 3}),
    ("chat-content-null", "/v1/chat/completions",
     {"model": BASE, "messages": [{"role": "assistant", "content": None}, *_USER], "max_tokens": 3}),
    ("chat-content-int", "/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": 5}], "max_tokens": 3}),
    ("chat-unknown-role", "/v1/chat/completions", {"model": BASE, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 3}),
    ("chat-max_completion_tokens", "/v1/chat/completions", {"model": BASE, "messages": _USER, "max_completion_tokens": 3}),
    ("chat-continue_final_message", "/v1/chat/completions",
     {"model": BASE, "messages": [*_USER, {"role": "assistant", "content": "well"}], "max_tokens": 3,
      "continue_final_message": True, "add_generation_prompt": False}),
    ("chat-tools-without-a-parser", "/v1/chat/completions",
     {"model": BASE, "messages": _USER, "max_tokens": 3,
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    ("responses", "/v1/responses", {"model": BASE, "input": "hi", "max_output_tokens": 16}),
    ("anthropic-messages", "/v1/messages", {"model": BASE, "max_tokens": 3, "messages": _USER}),
    ("tokenize", "/tokenize", {"model": BASE, "prompt": "hi"}),
    ("embeddings-not-served", "/v1/embeddings", {"model": BASE, "input": "hi"}),
]  # fmt: skip


@pytest.mark.parametrize("variant", ["processed", "workers"])  # (a worker answers refusals itself)
@pytest.mark.parametrize(("path", "body"), [(p, b) for _, p, b in _BODIES], ids=[i for i, _, _ in _BODIES])
def test_what_vllm_serves_is_routed_and_what_it_refuses_is_refused(
    tier: Tier, path: str, body: object, variant: str
) -> None:
    # The picker is never stricter than the server behind it, nor laxer where that would hide the server's
    # answer: the status through Envoy and the picker is the server's own (checked once against vLLM 0.32
    # with 49 bodies, ad hoc, all the same; these are the ones whose fields the picker reads).
    raw = json.dumps(body).encode()
    direct = post(f"{tier.servers['b'].url}{path}", raw)[0]
    through = post(f"{tier.route(variant)[0]}{path}", raw)[0]
    assert through == direct, (through, direct)


def test_a_body_vllm_refuses_gets_the_pickers_own_400(tier: Tier) -> None:
    status, body = post(f"{tier.url}/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400
    assert b"JSON" in body or b"json" in body, body  # says what was wrong
    assert post(f"{tier.servers['b'].url}/v1/completions", b'{"model": "tiny", "prompt": ')[0] == 400


def test_a_repeated_long_prompt_stays_on_one_server_and_its_real_hits_rise(tier: Tier) -> None:
    prompt = _prompt(7, 150)  # several of vLLM's 128-token blocks (~4 tokens a word), under max-model-len
    before = _queries(tier)
    hits_before = {name: s.counter("vllm:prefix_cache_hits_total") for name, s in tier.servers.items()}
    for _ in range(4):
        status, body = post(f"{tier.url}/v1/completions", {"model": BASE, "prompt": prompt, "max_tokens": 2})
        assert status == 200, body
    after = _queries(tier)
    served = [name for name in tier.servers if after[name] > before[name]]
    assert len(served) == 1, (before, after)  # all four went to one server
    (name,) = served
    assert tier.servers[name].counter("vllm:prefix_cache_hits_total") > hits_before[name]


def test_adapter_requests_never_404_while_a_server_serves_the_adapter(tier: Tier) -> None:
    statuses = [
        post(f"{tier.url}/v1/completions", {"model": ADAPTER, "prompt": _prompt(100 + i, 8), "max_tokens": 2})[0]
        for i in range(8)
    ]
    assert statuses == [200] * 8


def test_base_model_requests_spread_over_the_servers(tier: Tier) -> None:
    before = _queries(tier)
    for i in range(10):
        status, _ = post(f"{tier.url}/v1/completions", {"model": BASE, "prompt": _prompt(200 + i, 20), "max_tokens": 2})
        assert status == 200
    after = _queries(tier)
    assert all(after[name] > before[name] for name in tier.servers), (before, after)


def test_the_picker_knows_each_servers_cache_size_and_served_models(tier: Tier) -> None:
    pool = {
        e["address"]: e
        for e in json.loads(get(f"http://127.0.0.1:{tier.picker.metrics_port}/debug/pool")[1])["endpoints"]
    }
    for name, server in tier.servers.items():
        page = get(f"{server.url}/metrics/")[1].decode()
        real = int(float(re.search(r'vllm:cache_config_info\{[^}]*kv_cache_size_tokens="([^"]+)"', page).group(1)))
        seen = pool[server.hostport]
        # The prefix index sizes each pod from this: its capacity in tokens is the pod's own cache.
        assert seen["metrics"]["kv_cache_size_tokens"] == real > 0, (name, seen["metrics"])
        print(
            f"server {name}: kv_cache_size_tokens {real}, block_size {seen['metrics']['block_size']}, "
            f"num_gpu_blocks {seen['metrics']['num_gpu_blocks']}"
        )
        served = seen["served"]
        assert served["listed"] and served["base_models"] == [BASE]
        assert served["adapters"] == ({ADAPTER: BASE} if name == "a" else {}), served


def test_zz_a_stopped_server_goes_stale_and_is_avoided(tier: Tier) -> None:
    tier.servers["b"].stop()
    deadline = time.monotonic() + 30
    ok_in_a_row = 0
    while ok_in_a_row < 8:
        assert time.monotonic() < deadline, "requests still went to the stopped server after 30 s"
        status, _ = post(f"{tier.url}/v1/completions", {"model": BASE, "prompt": "after b stopped", "max_tokens": 2})
        ok_in_a_row = ok_in_a_row + 1 if status == 200 else 0
