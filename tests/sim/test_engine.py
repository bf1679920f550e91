import asyncio
from collections.abc import AsyncIterator

import pytest

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.request import RequestState, SimRequest, Sink
from epp.sim.tokens import render_completion

FAST = 0.02  # wall seconds per simulated second


@pytest.fixture
async def make_engine() -> AsyncIterator:
    engines: list[Engine] = []

    def make(**overrides: object) -> Engine:
        engine = Engine(EngineConfig(time_scale=FAST, **overrides))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def _submit(engine: Engine, prompt: str, max_tokens: int = 8, model: str | None = None,
            ignore_eos: bool = True) -> SimRequest:
    req = engine.new_request(model or engine.config.model, render_completion(prompt), max_tokens=max_tokens,
                             ignore_eos=ignore_eos, sink=Sink())
    engine.submit(req)
    return req


async def _done(*reqs: SimRequest) -> None:
    for req in reqs:
        while not req.finished:
            await req.sink.wait()


async def test_same_seed_same_outputs_and_cache_behaviour(make_engine) -> None:
    runs = []
    for seed in (7, 7, 8):
        engine = make_engine(seed=seed, mean_output_tokens=12)
        texts = []
        for i in range(6):
            req = _submit(engine, f"shared system prompt {'x' * 200} question {i % 3}", max_tokens=40,
                          ignore_eos=False)
            await _done(req)
            texts.append((req.text(), req.num_output, req.finish_reason, req.prefix_hit_tokens))
        runs.append((texts, engine.stats.prefix_cache_hits, engine.stats.generation_tokens))
    assert runs[0] == runs[1]
    assert [t[0] for t in runs[0][0]] != [t[0] for t in runs[2][0]]
    assert any(reason == "stop" for _, _, reason, _ in runs[0][0])


async def test_batch_limit_queues_fcfs(make_engine) -> None:
    engine = make_engine(max_num_seqs=2)
    reqs = [_submit(engine, f"prompt {i}", max_tokens=200) for i in range(5)]
    while engine.num_running < 2:
        await asyncio.sleep(0.001)
    assert engine.num_running == 2 and engine.num_waiting == 3
    await _done(*reqs)
    starts = [r.scheduled_t for r in reqs]
    assert starts == sorted(starts)  # first come, first served
    assert engine.stats.queue.sum > 0


async def test_chunked_prefill_costs_uncached_tokens_only(make_engine) -> None:
    engine = make_engine(max_num_batched_tokens=512)
    long_prompt = "y" * 16_000  # 4k tokens: 8 steps of 512
    cold = _submit(engine, long_prompt + " a", max_tokens=1)
    await _done(cold)
    warm = _submit(engine, long_prompt + " b", max_tokens=1)
    await _done(warm)
    assert cold.prefix_hit_tokens == 0 and warm.prefix_hit_tokens == 4000
    cold_ttft = cold.first_token_t - cold.arrival_t
    warm_ttft = warm.first_token_t - warm.arrival_t
    assert cold_ttft >= 4001 * engine.config.prefill_token_s + 8 * engine.config.step_base_s
    assert warm_ttft < cold_ttft / 5


async def test_preemption_under_kv_pressure_recomputes_and_completes(make_engine) -> None:
    # 16 blocks of 16 tokens; four requests that each grow to ~190 tokens cannot all fit.
    engine = make_engine(num_gpu_blocks=16, max_model_len=256)
    reqs = [_submit(engine, f"{i}" * 160, max_tokens=150) for i in range(4)]
    await _done(*reqs)
    assert engine.stats.preemptions > 0
    assert all(r.num_output == 150 and r.finish_reason == "length" for r in reqs)
    assert engine.kv.num_used == 0
    # Preemption does not change what a request generates.
    alone = make_engine(num_gpu_blocks=16, max_model_len=256)
    again = _submit(alone, "0" * 160, max_tokens=150)
    await _done(again)
    assert again.text() == reqs[0].text()


async def test_lora_slots_and_load_delay(make_engine) -> None:
    engine = make_engine(lora_adapters=("a", "b"), max_loras=1, lora_load_s=0.2)
    first = _submit(engine, "to a", model="a", max_tokens=100)
    while first.state is not RequestState.RUNNING:
        await asyncio.sleep(0.001)
    blocked = _submit(engine, "to b", model="b", max_tokens=4)
    base = _submit(engine, "to base", max_tokens=4)
    await _done(base)  # the base model passes the request waiting for an adapter slot
    assert not blocked.finished and blocked.state is RequestState.WAITING
    assert engine.running_loras() == ["a"] and engine.waiting_loras() == ["b"]
    # Passed over for the LoRA budget: vLLM 0.32 counts it as reason="deferred" until it is admitted.
    assert engine.num_waiting == engine.num_deferred == 1
    await _done(first, blocked)
    assert engine.num_deferred == 0
    assert engine.lora_loads == 2 and engine.resident_loras == ("b",)
    warm = _submit(engine, "to b again", model="b", max_tokens=4)
    await _done(warm)
    assert engine.lora_loads == 2
    cold_ttft = blocked.first_token_t - blocked.scheduled_t
    warm_ttft = warm.first_token_t - warm.scheduled_t
    assert cold_ttft >= 0.2 > warm_ttft
    assert engine.lora_info and next(reversed(engine.lora_info)) == ("", "")


async def test_abort_frees_blocks_and_counts(make_engine) -> None:
    engine = make_engine(max_num_seqs=1)
    running = _submit(engine, "long", max_tokens=10_000)
    waiting = _submit(engine, "queued", max_tokens=4)
    while running.state is not RequestState.RUNNING:
        await asyncio.sleep(0.001)
    engine.abort(waiting)
    engine.abort(running)
    assert engine.num_running == engine.num_waiting == 0 and engine.kv.num_used == 0
    assert engine.stats.request_success["abort"] == 2


async def test_stop_aborts_unfinished_requests(make_engine) -> None:
    engine = make_engine()
    req = _submit(engine, "never finishes", max_tokens=100_000)
    await asyncio.sleep(0.01)
    await engine.stop()
    assert req.finished and req.finish_reason == "abort"


async def test_invalid_requests(make_engine) -> None:
    engine = make_engine(max_model_len=64, num_gpu_blocks=8)
    with pytest.raises(KeyError):
        engine.new_request("nope", render_completion("x"), max_tokens=1, ignore_eos=False, sink=Sink())
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.new_request(engine.config.model, render_completion("x" * 400), max_tokens=1, ignore_eos=False,
                           sink=Sink())
    with pytest.raises(ValueError):
        EngineConfig(num_gpu_blocks=2, max_model_len=64)
