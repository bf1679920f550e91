"""A simulated pod's KV events describe exactly what its cache holds: a subscriber that follows them (the
picker's, epp.prefix.kvsubscriber) ends with the engine's cached blocks, and its keys match a request's
blocks as the engine counts its hits. Real sockets (ipc, bound by the pod as vLLM binds ipc endpoints)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvsubscriber import KVEventSubscriber
from epp.sim import EngineConfig, SimulatedPool
from epp.sim.config import KVEventsConfig
from epp.sim.kvcache import block_hashes, model_seed
from epp.sim.tokens import render_completion

MODEL = "m"
POD = "127.0.0.1:8000"


def _config(tmp_path: Path, *, replay: bool = True, blocks: int = 48, name: str = "pub") -> EngineConfig:
    events = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"ipc://{tmp_path}/{name}",
        replay_endpoint=f"ipc://{tmp_path}/{name}-replay" if replay else None, topic=f"kv@{POD}@{MODEL}",
    )
    return EngineConfig(model=MODEL, time_scale=0.02, num_gpu_blocks=blocks, max_model_len=blocks * 16,
                        max_num_seqs=4, kv_events=events, seed=3)


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def _prompts(rng: random.Random, n: int) -> list[str]:
    """Prompts sharing a few prefixes, 100-400 tokens (4 characters each): a cache of 48 blocks evicts."""
    stems = ["".join(rng.choice("abcdefgh") for _ in range(4 * rng.randint(50, 250))) for _ in range(4)]
    return [rng.choice(stems) + "".join(rng.choice("xyz ") for _ in range(4 * rng.randint(1, 150))) for _ in range(n)]


async def _send(session: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()


async def _workload(url: str, prompts: list[str], concurrency: int = 3) -> None:
    async with aiohttp.ClientSession() as session:
        queue = list(prompts)

        async def worker() -> None:
            while queue:
                await _send(session, url, queue.pop())

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _follow(sub: KVEventSubscriber, engine, replay: bool = True) -> None:
    """Follow the pod, and wait until the subscription has reached its publisher (probing with a
    BlockRemoved of nothing, harmless) so that no batch of the test is sent before it."""
    publisher = engine.publisher
    sub.follow(POD, publisher.endpoint, publisher.replay_endpoint if replay else None)
    while sub.last_seq(POD) is None or sub.last_seq(POD) != publisher.seq - 1:
        publisher.removed([2**63])
        publisher.flush()
        await asyncio.sleep(0.02)


async def _settled(sub: KVEventSubscriber, publisher) -> None:
    await _until(lambda: sub.last_seq(POD) == publisher.seq - 1)


def _agrees(sub: KVEventSubscriber, engine, prompts: list[str]) -> None:
    """The subscriber holds exactly the engine's cached blocks, and matches each prompt as the engine would."""
    assert sub.index.engine_hashes(POD) == engine.kv.cached_hashes()
    seed = model_seed(MODEL)
    for prompt in prompts:
        ids = render_completion(prompt)
        hits = engine.kv.count_hits(block_hashes(ids, seed).tolist(), len(ids) // 16)
        matched = sub.index.match(chain_keys(ids, 16)).get(POD, (0, 0.0))[0]
        assert matched == hits, prompt[:20]


async def test_after_a_workload_with_evictions_two_subscribers_hold_exactly_the_cache(tmp_path: Path) -> None:
    async with SimulatedPool(1, _config(tmp_path)) as pool:
        engine = pool[0].engine
        subs = [KVEventSubscriber(KVEventIndex()) for _ in range(2)]
        try:
            # The first starts before any event, the second after the first batches: it replays them.
            await _follow(subs[0], engine)
            prompts = _prompts(random.Random(7), 60)
            await _workload(pool.url(0), prompts[:20])
            subs[1].follow(POD, engine.publisher.endpoint, engine.publisher.replay_endpoint)
            await _workload(pool.url(0), prompts[20:])
            assert engine.kv.evictions > 0  # the cache was too small for the workload
            for sub in subs:
                await _settled(sub, engine.publisher)
            _agrees(subs[0], engine, prompts)
            _agrees(subs[1], engine, prompts)
            assert subs[0].index.engine_hashes(POD) == subs[1].index.engine_hashes(POD)
            assert subs[0].index.blocks_of(POD) == subs[1].index.blocks_of(POD)
        finally:
            for sub in subs:
                await sub.close()


async def test_a_lost_batch_is_replayed_and_without_replay_the_pod_is_dropped(tmp_path: Path) -> None:
    for replay in (True, False):
        config = _config(tmp_path, replay=replay, name=f"lost-{replay}")
        async with SimulatedPool(1, config) as pool:
            engine = pool[0].engine
            sub = KVEventSubscriber(KVEventIndex())
            try:
                await _follow(sub, engine, replay)
                replays = sub.stats.replays  # catching up with the probes sent before the subscription
                prompts = _prompts(random.Random(11), 30)
                await _workload(pool.url(0), prompts[:10], concurrency=1)
                flush = engine.publisher.flush
                engine.publisher.flush = lambda send=True, flush=flush: flush(send=False)  # the next batch is lost
                await _workload(pool.url(0), prompts[10:11], concurrency=1)
                engine.publisher.flush = flush
                await _workload(pool.url(0), prompts[11:], concurrency=1)
                await _settled(sub, engine.publisher)
                assert sub.stats.gaps == 1
                if replay:
                    assert sub.stats.replays == replays + 1
                    _agrees(sub, engine, prompts)
                else:
                    # Blocks from before the hole are forgotten: what is left is a subset of the cache.
                    assert sub.index.engine_hashes(POD) <= engine.kv.cached_hashes()
                    assert sub.index.known(POD)
            finally:
                await sub.close()


async def test_reset_prefix_cache_is_announced_with_the_next_step(tmp_path: Path) -> None:
    async with SimulatedPool(1, _config(tmp_path)) as pool, aiohttp.ClientSession() as session:
        engine = pool[0].engine
        sub = KVEventSubscriber(KVEventIndex())
        try:
            await _follow(sub, engine)
            prompts = _prompts(random.Random(3), 8)
            await _workload(pool.url(0), prompts)
            await _settled(sub, engine.publisher)
            assert sub.index.engine_hashes(POD)
            async with session.post(pool.url(0) + "/reset_prefix_cache") as r:
                assert r.status == 200 and await r.json() == {"success": True}
            assert engine.kv.cached_hashes() == set() and engine.publisher.pending == 1  # AllBlocksCleared, queued
            await _send(session, pool.url(0), prompts[0])
            await _settled(sub, engine.publisher)
            _agrees(sub, engine, prompts)  # only the last request's blocks
            assert sub.index.engine_hashes(POD) and sub.stats.resets == 0
        finally:
            await sub.close()


async def test_reset_fails_while_requests_hold_blocks_unless_they_are_preempted(tmp_path: Path) -> None:
    config = replace(_config(tmp_path), time_scale=1.0)  # slow enough to catch a request running
    async with SimulatedPool(1, config) as pool, aiohttp.ClientSession() as session:
        engine = pool[0].engine
        task = asyncio.create_task(_send(session, pool.url(0), "x" * 400))
        await _until(lambda: engine.num_running == 1)
        async with session.post(pool.url(0) + "/reset_prefix_cache") as r:
            assert await r.json() == {"success": False}
        async with session.post(pool.url(0) + "/reset_prefix_cache?reset_running_requests=true") as r:
            assert await r.json() == {"success": True}
        await task  # preempted, recomputed, answered


async def test_a_restarted_pod_starts_its_seq_again_and_the_subscriber_clears_it(tmp_path: Path) -> None:
    config = _config(tmp_path, replay=False)
    sub = KVEventSubscriber(KVEventIndex())
    try:
        prompts = _prompts(random.Random(5), 12)
        async with SimulatedPool(1, config) as pool:
            engine = pool[0].engine
            await _follow(sub, engine, replay=False)
            await _workload(pool.url(0), prompts)
            await _settled(sub, engine.publisher)
            _agrees(sub, engine, prompts)
        async with SimulatedPool(1, config) as pool:  # the same endpoint: the process restarted
            engine = pool[0].engine
            await _until(lambda: not sub.index.known(POD))  # the connection dropped
            await _follow(sub, engine, replay=False)  # ZMQ reconnects by itself; the seq started again
            await _workload(pool.url(0), prompts[:2], concurrency=1)
            await _settled(sub, engine.publisher)
            _agrees(sub, engine, prompts)
            assert sub.stats.disconnects >= 1
    finally:
        await sub.close()


async def test_old_array_events_describe_the_cache_too(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config = replace(config, kv_events=replace(config.kv_events, array_events=True))
    async with SimulatedPool(1, config) as pool:
        engine = pool[0].engine
        sub = KVEventSubscriber(KVEventIndex())
        try:
            await _follow(sub, engine)
            prompts = _prompts(random.Random(9), 30)
            await _workload(pool.url(0), prompts)
            await _settled(sub, engine.publisher)
            _agrees(sub, engine, prompts)
        finally:
            await sub.close()


@pytest.mark.parametrize("lora", [False, True])
async def test_adapter_blocks_carry_the_adapters_name_and_match_only_adapter_lookups(
    tmp_path: Path, lora: bool
) -> None:
    config = replace(_config(tmp_path, blocks=256), lora_adapters=("ad1",))
    async with SimulatedPool(1, config) as pool, aiohttp.ClientSession() as session:
        engine = pool[0].engine
        sub = KVEventSubscriber(KVEventIndex())
        try:
            await _follow(sub, engine)
            prompt = "q" * 400
            body = {"model": "ad1" if lora else MODEL, "prompt": prompt, "max_tokens": 2}
            async with session.post(pool.url(0) + "/v1/completions", json=body) as r:
                assert r.status == 200
            await _settled(sub, engine.publisher)
            ids = np.asarray(render_completion(prompt))
            plain = sub.index.match(chain_keys(ids, 16)).get(POD, (0, 0))[0]
            adapter = sub.index.match(chain_keys(ids, 16, lora_name="ad1")).get(POD, (0, 0))[0]
            whole = len(ids) // 16
            assert (plain, adapter) == ((0, whole) if lora else (whole, 0))
        finally:
            await sub.close()
