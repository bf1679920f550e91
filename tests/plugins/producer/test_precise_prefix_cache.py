"""precise-prefix-cache-producer against the simulator's publisher: events route a prompt sent straight to a
pod (bypassing the picker) back to that pod; pods that publish nothing keep the approximate match."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

import epp.plugins.producer.precise_prefix_cache as precise_module
from epp.datalayer.datastore import Datastore
from epp.framework import PREFIX_MATCH, Api, Endpoint, Handle, InferenceRequest, Profile, SchedulingResult
from epp.plugins.picker.max_score import MaxScorePicker
from epp.plugins.producer.precise_prefix_cache import (
    _DEFERRED,
    TOKENIZED_PROMPT,
    PreciseParameters,
    PrecisePrefixCacheProducer,
    _InFlight,
    _Tokenization,
)
from epp.plugins.scorer.prefix_cache import PrefixCacheScorer
from epp.prefix.kvindex import chain_keys
from epp.prefix.kvwire import BlockStored
from epp.prefix.tokenize import ModelTokenizer, Plan
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.scheduling.runner import Scheduler
from epp.sim import EngineConfig, SimulatedPool
from epp.sim.config import KVEventsConfig
from epp.sim.kvcache import block_hashes, model_seed
from epp.sim.kvevents import KVEventPublisher
from epp.sim.tokens import render_chat, render_completion, write_model_files
from epp.testing.envoy import free_port, free_port_run
from epp.testing.tokenizer import write_tokenizer_dir

BS = 4


def _ask(prompt: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", model="m", prompt=prompt)


def _tokens(request: InferenceRequest) -> list[int]:
    return [ord(c) for c in request.prompt]  # a stand-in tokenizer: one token per character


async def test_a_prompt_sent_straight_to_a_pod_is_routed_to_it() -> None:
    port = free_port()
    # Two pods on distinct loopback addresses, the publisher port the same on both (socketPort).
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    # pod-b publishes nothing; pod-a's publisher binds the port as vLLM's tcp://*:PORT would (loopback here).
    pub_a = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@127.0.0.1:8000@m", bind=True)
    parameters = PreciseParameters(
        "p", {"podDiscoveryConfig": {"socketPort": port}, "tokenProcessorConfig": {"blockSize": BS}}
    )
    producer = PrecisePrefixCacheProducer("p", parameters, Handle(Datastore(pods)), tokenizer=_tokens)
    try:
        request = _ask("the system prompt, then a question")
        producer.produce(request, pods)  # starts the subscriber on this loop
        assert producer.subscriber is not None
        while producer.subscriber.stats.batches == 0:  # until the subscription reached the publisher
            pub_a.cleared()
            pub_a.flush()
            await asyncio.sleep(0.02)
        # The prompt reached pod-a without the picker: only its events say so.
        ids = _tokens(request)
        n = len(ids) // BS
        pub_a.stored(list(range(1, n + 1)), None, ids[: n * BS], BS)
        pub_a.flush()
        for _ in range(250):
            producer.produce(request, pods)
            if request.state[PREFIX_MATCH].matched.get("pod-a"):
                break
            await asyncio.sleep(0.02)
        match = request.state[PREFIX_MATCH]
        assert match.blocks == n and match.block_tokens == BS
        assert match.matched["pod-a"] == n and "pod-b" not in match.matched
        assert PrefixCacheScorer().score(request, pods) == [1.0, 0.0]
    finally:
        pub_a.close()
        await producer.close()


async def _ranks_server(sources: dict[str, dict[str, object]]) -> tuple[web.AppRunner, int]:
    """A stand-in for vLLM's API server in front of data-parallel ranks: its /kv_event_sources."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(sources)

    app = web.Application()
    app.router.add_get("/kv_event_sources", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def _matched_by_rank_1(producer: PrecisePrefixCacheProducer, pods: list[Endpoint],
                             publishers: list[KVEventPublisher]) -> InferenceRequest:  # fmt: skip
    """Rank 1 stores a prompt's blocks (rank 0 stays quiet but for clears): the request after it."""
    request = _ask("held by the second engine behind the server")
    ids = _tokens(request)
    n = len(ids) // BS
    for _ in range(500):
        producer.produce(request, pods)  # the first call starts the subscriber on this loop
        if request.state[PREFIX_MATCH].matched.get("pod-a"):
            break
        for publisher in publishers:
            publisher.cleared()
        publishers[1].stored(list(range(1, n + 1)), None, ids[: n * BS], BS)
        for publisher in publishers:
            publisher.flush()
        await asyncio.sleep(0.02)
    return request


async def test_every_data_parallel_rank_behind_one_server_is_followed() -> None:
    """vllm serve --data-parallel-size 2 (one API server, rank r publishing on the port + r): the server's
    /kv_event_sources names both ranks, and rank 1's blocks count for the endpoint."""
    port = free_port_run(2)  # rank 1 binds the port + 1
    publishers = [KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@127.0.0.1@m", bind=True, data_parallel_rank=r)
                  for r in range(2)]  # fmt: skip
    runner, http = await _ranks_server({str(r): {"endpoint": f"tcp://*:{port + r}", "replay_endpoint": None}
                                        for r in range(2)})  # fmt: skip
    pods = [Endpoint("pod-a", "127.0.0.1", http, kv_events_port=port)]
    parameters = PreciseParameters("p", {"tokenProcessorConfig": {"blockSize": BS}})
    producer = PrecisePrefixCacheProducer("p", parameters, Handle(Datastore(pods)), tokenizer=_tokens)
    try:
        request = await _matched_by_rank_1(producer, pods, publishers)
        assert request.state[PREFIX_MATCH].matched["pod-a"] == len(_tokens(request)) // BS
        assert producer.subscriber is not None
        assert set(producer.subscriber.index.pods()) == {f"127.0.0.1:{http}", f"127.0.0.1:{http}@1"}
    finally:
        for publisher in publishers:
            publisher.close()
        await producer.close()
        await runner.cleanup()


async def test_binding_every_data_parallel_rank_behind_one_server_connects() -> None:
    """The same server configured to connect to the picker: rank 1 connects to the bound port + 1, which
    the picker binds once the server says it runs two ranks (the pool has one endpoint on its ip)."""
    port = free_port_run(2)  # the picker binds the port + 1 for rank 1
    runner, http = await _ranks_server({str(r): {"endpoint": f"tcp://127.0.0.1:{port + r}"} for r in range(2)})
    publishers = [KVEventPublisher(f"tcp://127.0.0.1:{port}", f"kv@127.0.0.1:{http}@m", bind=False,
                                   data_parallel_rank=r) for r in range(2)]  # fmt: skip
    pods = [Endpoint("pod-a", "127.0.0.1", http)]
    parameters = PreciseParameters(
        "p", {"kvEventsConfig": {"zmqEndpoint": f"tcp://127.0.0.1:{port}"}, "tokenProcessorConfig": {"blockSize": BS}}
    )
    producer = PrecisePrefixCacheProducer("p", parameters, Handle(Datastore(pods)), tokenizer=_tokens)
    try:
        request = await _matched_by_rank_1(producer, pods, publishers)
        assert request.state[PREFIX_MATCH].matched["pod-a"] == len(_tokens(request)) // BS
        assert producer.subscriber is not None
        assert producer.subscriber.rank_endpoints == {1: f"tcp://127.0.0.1:{port + 1}"}
    finally:
        for publisher in publishers:
            publisher.close()
        await producer.close()
        await runner.cleanup()


async def test_binding_a_pod_that_published_before_it_connected_is_caught_up_from_its_replay_socket() -> None:
    """Bind mode (kvEventsConfig.zmqEndpoint): the pool's kv-replay port is dialled as when connecting."""
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@127.0.0.1:8000@m", replay_endpoint="tcp://127.0.0.1:*")
    assert pub.replay_endpoint is not None
    replay_port = int(pub.replay_endpoint.rsplit(":", 1)[1])
    pods = [Endpoint("pod-a", "127.0.0.1", 8000, kv_replay_port=replay_port)]
    parameters = PreciseParameters(
        "p", {"kvEventsConfig": {"zmqEndpoint": f"tcp://127.0.0.1:{port}"}, "tokenProcessorConfig": {"blockSize": BS}}
    )
    producer = PrecisePrefixCacheProducer("p", parameters, Handle(Datastore(pods)), tokenizer=_tokens)
    try:
        request = _ask("said once, before the picker listened")
        ids = _tokens(request)
        n = len(ids) // BS
        pub.stored(list(range(1, n + 1)), None, ids[: n * BS], BS)
        pub.flush()  # nobody subscribed yet: only the replay socket still has it; then the pod is quiet
        for _ in range(250):
            producer.produce(request, pods)  # the first call starts the subscriber on this loop
            if request.state[PREFIX_MATCH].matched.get("pod-a"):
                break
            await asyncio.sleep(0.02)
        assert request.state[PREFIX_MATCH].matched["pod-a"] == n
    finally:
        pub.close()
        await producer.close()


def test_the_approximate_index_is_left_out_while_every_candidate_publishes() -> None:
    """Its answer would be dropped for every pod: not looked up, not fed. A candidate whose events are
    not followed brings it back, for that pod's match and for what is sent there."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer = PrecisePrefixCacheProducer(
        "p", PreciseParameters("p", {"tokenProcessorConfig": {"blockSize": BS}, "blockSizeTokens": BS}),
        Handle(Datastore(pods)), tokenizer=_tokens,
    )  # fmt: skip
    looked_up: list[str] = []
    approximate_produce = producer.approximate.produce
    producer.approximate.produce = lambda r, c: (looked_up.append(r.prompt), approximate_produce(r, c))[1]  # type: ignore[method-assign]
    ids = _tokens(_ask("a prompt both pods have seen parts of"))
    n = len(ids) // BS
    producer.index.apply("127.0.0.1:8000", [BlockStored(list(range(1, n + 1)), None, ids[: n * BS], BS)])
    producer.index.apply("127.0.0.2:8000", [BlockStored([101], None, ids[:BS], BS)])

    def route(prompt: str, to: Endpoint) -> InferenceRequest:
        request = _ask(prompt)
        producer.produce(request, pods)
        producer.pre_request(request, SchedulingResult({"default": [to]}, "default"))
        return request

    request = route("a prompt both pods have seen parts of", pods[1])
    assert request.state[PREFIX_MATCH].matched == {"pod-a": n, "pod-b": 1}
    assert looked_up == [] and len(producer.approximate.index) == 0  # neither consulted nor fed

    producer.index.mark_unknown("127.0.0.2:8000")  # a hole in pod-b's stream: its match is the approximate one
    route("what the picker sends pod-b now", pods[1])
    request = route("what the picker sends pod-b now", pods[0])
    assert looked_up == ["what the picker sends pod-b now"] * 2
    assert request.state[PREFIX_MATCH].matched["pod-b"] > 0  # the approximate index learned the first one


def test_a_pod_whose_events_are_followed_is_matched_by_them_even_where_the_approximate_index_says_more() -> None:
    """In a mixed pool the approximate index runs, and remembers what the picker sent to every pod; for a
    pod whose events are followed only the events count (here: it evicted most of what it was sent)."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]  # pod-b publishes nothing
    producer = PrecisePrefixCacheProducer(
        "p", PreciseParameters("p", {"tokenProcessorConfig": {"blockSize": BS}, "blockSizeTokens": BS, "inFlightTTL": "0s"}),
        Handle(Datastore(pods)), tokenizer=_tokens,
    )  # fmt: skip
    prompt = "a prompt sent to pod-a, which then evicted all but its first block"
    ids = _tokens(_ask(prompt))
    producer.index.apply("127.0.0.1:8000", [])  # pod-a's events are followed
    first = _ask(prompt)
    producer.produce(first, pods)
    producer.pre_request(first, SchedulingResult({"default": [pods[0]]}, "default"))  # the approximate index learns
    producer.index.apply("127.0.0.1:8000", [BlockStored([1], None, ids[:BS], BS)])
    again = _ask(prompt)
    producer.produce(again, pods)
    assert producer.approximate.index.lookup(again.state[producer.approximate._lookup].hashes).matches["pod-a"] > 1
    assert again.state[PREFIX_MATCH].matched == {"pod-a": 1}


def test_without_a_tokenizer_the_approximate_match_stands() -> None:
    pods = [Endpoint("pod-a", "127.0.0.1", 8000)]
    producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", {"blockSizeTokens": BS}), Handle(Datastore(pods)))
    request = _ask("x" * 64)
    producer.produce(request, pods)
    assert producer.subscriber is None  # no loop running: nothing started
    assert request.state[PREFIX_MATCH].blocks == 4  # the approximate producer's blocks (16 characters)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"kvEventsConfig": {"zmqEndpoint": "tcp://*:5557", "bogus": 1}}, "bogus"),
        ({"podDiscoveryConfig": {"socketPort": 0}}, "socketPort"),
        ({"tokenProcessorConfig": "16"}, "tokenProcessorConfig must be a mapping"),
        ({"maxBlocksPerPod": True}, "maxBlocksPerPod"),
    ],
)
def test_bad_parameters_name_what_is_wrong(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PreciseParameters("p", parameters)


# -- against simulated pods: the pool names each pod's publisher ------------------------------------------


def _sim_config(**overrides: object) -> EngineConfig:
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", topic="kv@127.0.0.1@m")
    fields = {"model": "m", "time_scale": 0.02, "num_gpu_blocks": 64, "max_model_len": 1024, "kv_events": events,
              "max_num_seqs": 4}
    return EngineConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def _pool_endpoints(pool: SimulatedPool) -> list[Endpoint]:
    """The pods as a static endpoints file would name them: ip:port and kv-events=/kv-replay= ports."""
    endpoints = []
    for pod in pool:
        publisher = pod.engine.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        endpoints.append(Endpoint(pod.name, "127.0.0.1", pod.port,
                                  kv_events_port=int(publisher.endpoint.rsplit(":", 1)[1]),
                                  kv_replay_port=int(publisher.replay_endpoint.rsplit(":", 1)[1])))
    return endpoints


def _sim_tokens(request: InferenceRequest) -> np.ndarray:
    return render_completion(request.prompt)  # the simulator's own tokenizer, as its /tokenize answers


async def _post(url: str, prompt: str) -> None:
    async with aiohttp.ClientSession() as session:
        body = {"model": "m", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200


async def _caught_up(producer: PrecisePrefixCacheProducer, pool: SimulatedPool) -> None:
    assert producer.subscriber is not None
    for _ in range(500):
        if all(pod.engine.publisher.seq == 0 or producer.subscriber.last_seq(f"127.0.0.1:{pod.port}")
               == pod.engine.publisher.seq - 1 for pod in pool):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the subscriber did not catch up")


async def test_each_pod_is_followed_at_the_port_the_pool_names_and_matches_its_cache() -> None:
    async with SimulatedPool(2, [_sim_config(seed=1), _sim_config(seed=2)]) as pool:
        endpoints = _pool_endpoints(pool)
        producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", {}), Handle(Datastore(endpoints)),
                                              tokenizer=_sim_tokens)
        try:
            producer.produce(_ask("warm"), endpoints)  # starts the subscriber
            rng = random.Random(4)
            stems = ["".join(rng.choice("abcd") for _ in range(4 * 120)) for _ in range(3)]
            prompts = [rng.choice(stems) + "q" * 4 * rng.randint(1, 60) for _ in range(30)]
            for i, prompt in enumerate(prompts):  # straight to the pods, bypassing any picker
                await _post(pool.url(i % 2), prompt)
            await _caught_up(producer, pool)
            seed = model_seed("m")
            for prompt in prompts:
                request = _ask(prompt)
                producer.produce(request, endpoints)
                ids = render_completion(prompt)
                for pod, endpoint in zip(pool, endpoints, strict=True):
                    hits = pod.engine.kv.count_hits(block_hashes(ids, seed).tolist(), len(ids) // 16)
                    assert request.state[PREFIX_MATCH].matched.get(endpoint.name, 0) == hits
            assert producer.subscriber is not None and producer.subscriber.stats.rejected_total == 0
        finally:
            await producer.close()


async def test_a_pod_that_moved_its_publisher_is_followed_at_the_new_port() -> None:
    async with SimulatedPool(1, _sim_config()) as old, SimulatedPool(1, _sim_config()) as new:
        store = Datastore(_pool_endpoints(old))
        producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", {}), Handle(store), tokenizer=_sim_tokens)
        try:
            producer.produce(_ask("warm"), store.endpoints())
            moved = replace(_pool_endpoints(new)[0], name="pod-0", port=old[0].port)  # same address, new publisher
            store.replace([moved])
            assert producer.subscriber is not None
            await _post(new.url(0), "z" * 200)
            for _ in range(300):
                producer.produce(request := _ask("z" * 200), store.endpoints())
                if request.state[PREFIX_MATCH].matched.get("pod-0"):
                    break
                await asyncio.sleep(0.01)
            assert request.state[PREFIX_MATCH].matched["pod-0"] == len(render_completion("z" * 200)) // 16
        finally:
            await producer.close()


def test_llm_d_parameters_are_accepted_where_llm_d_puts_them() -> None:
    p = PreciseParameters("p", {"kvEventsConfig": {"topicFilter": "kv@", "concurrency": 4, "discoverPods": True,
                                                   "podDiscoveryConfig": {"socketPort": 6000,
                                                                          "podLabelSelector": "app=vllm"}}})
    assert p.socket_port == 6000
    producer = PrecisePrefixCacheProducer("p", p, tokenizer=_tokens)
    assert producer.publisher_of(Endpoint("a", "10.0.0.1", 8000)) == ("tcp://10.0.0.1:6000", None)
    assert producer.publisher_of(Endpoint("a", "fd00::1", 8000, kv_events_port=5557, kv_replay_port=5558)) == (
        "tcp://[fd00::1]:5557", "tcp://[fd00::1]:5558")


async def test_the_simulated_models_files_look_up_what_a_default_simulator_holds(tmp_path: Path) -> None:
    """The picker tokenizes locally with the simulated model's files (epp.sim.tokens.write_model_files), the
    pods with their own default tokenization: chats sent straight to the pods are matched block for block."""
    model = write_model_files(tmp_path / "m")
    parameters = {"indexerConfig": {"tokenizersPoolConfig": {
        "modelName": "m", "local": {"autoDiscoveryDir": str(model)}, "remote": {"mode": "none"}}}}  # fmt: skip
    async with SimulatedPool(2, [_sim_config(seed=1), _sim_config(seed=2)]) as pool:
        endpoints = _pool_endpoints(pool)
        producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", parameters), Handle(Datastore(endpoints)))
        try:
            producer.produce(_ask("warm"), endpoints)  # starts the subscriber
            rng = np.random.default_rng(5)
            words = ["".join(chr(c) for c in stem) + " " for stem in rng.integers(97, 123, size=(400, 3))]
            systems = ["".join(rng.choice(words, size=int(n))) for n in (90, 130, 170)]
            chats = [[("system", systems[i % 3]), ("user", "".join(rng.choice(words, size=int(rng.integers(2, 40)))))]
                     for i in range(12)]  # fmt: skip
            async with aiohttp.ClientSession() as session:
                for i, chat in enumerate(chats):  # straight to the pods, bypassing any picker
                    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in chat], "max_tokens": 2}
                    async with session.post(pool.url(i % 2) + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200
            await _caught_up(producer, pool)
            seed = model_seed("m")
            matched_somewhere = 0
            for chat in chats:
                request = _chat([{"role": r, "content": c} for r, c in chat], model="m")
                await producer.prepare_data(request)
                producer.produce(request, endpoints)
                ids = render_chat(chat)
                assert request.state[TOKENIZED_PROMPT].tolist() == ids.tolist()
                for pod, endpoint in zip(pool, endpoints, strict=True):
                    hits = pod.engine.kv.count_hits(block_hashes(ids, seed).tolist(), len(ids) // 16)
                    assert request.state[PREFIX_MATCH].matched.get(endpoint.name, 0) == hits
                    matched_somewhere += hits
            assert matched_somewhere > 0
        finally:
            await _close(producer)


async def test_a_prefix_sent_to_a_pod_counts_there_until_its_events_store_it() -> None:
    async with SimulatedPool(2, [_sim_config(seed=1, time_scale=1.0), _sim_config(seed=2, time_scale=1.0)]) as pool:
        endpoints = _pool_endpoints(pool)
        producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", {}), Handle(Datastore(endpoints)),
                                              tokenizer=_sim_tokens)
        try:
            prompt = "w" * 4 * 200
            first = _ask(prompt)
            producer.produce(first, endpoints)
            assert first.state[PREFIX_MATCH].matched == {}
            producer.pre_request(first, SchedulingResult({"default": [endpoints[1]]}, "default"))  # sent to pod-1
            second = _ask(prompt)
            producer.produce(second, endpoints)  # before pod-1 has computed anything: in flight there
            blocks = len(render_completion(prompt)) // 16
            assert second.state[PREFIX_MATCH].matched == {"pod-1": blocks}
            assert len(producer.in_flight) == blocks
            await _post(pool.url(1), prompt)  # pod-1 computes it and says so
            await _caught_up(producer, pool)
            assert len(producer.in_flight) == 0  # confirmed by the events: they alone decide from now on
            third = _ask(prompt)
            producer.produce(third, endpoints)
            assert third.state[PREFIX_MATCH].matched == {"pod-1": blocks}
        finally:
            await producer.close()


def test_in_flight_blocks_expire_when_no_event_confirms_them() -> None:
    now = [0.0]
    in_flight = _InFlight(30.0, clock=lambda: now[0])
    in_flight.add("a", [1, 2, 3])
    in_flight.add("b", [1])
    now[0] = 29.0
    in_flight.prune()
    assert dict(in_flight.holders(1)) == {"a": 30.0, "b": 30.0}
    in_flight.confirm("b", [1])
    now[0] = 30.0
    in_flight.prune()
    assert len(in_flight) == 0
    assert PreciseParameters("p", {"inFlightTTL": "0s"}).in_flight_ttl == 0.0
    off = _InFlight(0.0)
    off.add("a", [1])
    assert len(off) == 0


def test_the_in_flight_record_is_bounded_oldest_requests_first() -> None:
    """Blocks no event confirms (a tokenizer that is not the served model's) must not pile up for the TTL."""
    in_flight = _InFlight(30.0, max_keys=5)
    in_flight.add("a", [1, 2, 3])
    in_flight.add("b", [3, 4])
    assert len(in_flight) == 4 and in_flight.shed == 0
    in_flight.add("a", [5, 6])  # 6 keys: the oldest request's go
    assert len(in_flight) == 4 and in_flight.shed == 1
    assert not in_flight.holders(1) and dict(in_flight.holders(3)).keys() == {"b"}
    in_flight.add("c", list(range(10, 20)))  # alone over the bound: kept, the others dropped
    assert len(in_flight) == 10 and in_flight.shed == 3


# --- tokenization: the model's files, else the engine ---------------------------------------------



@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An auto-discovery directory holding one model's tokenizer files, as llm-d lays them out."""
    root = tmp_path_factory.mktemp("models")
    write_tokenizer_dir(root / "org" / "tiny", template="chatml-tools", add_bos=False)
    return root


def _tokenizing(models: Path, **pool: object) -> dict[str, object]:
    return {"tokenProcessorConfig": {"blockSize": BS}, "indexerConfig": {"tokenizersPoolConfig": {
        "modelName": "org/tiny", "local": {"autoDiscoveryDir": str(models)}, **pool}}}  # fmt: skip


def _chat(messages: list[dict], model: str = "org/tiny") -> InferenceRequest:
    body = json.dumps({"model": model, "messages": messages}).encode()
    return InferenceRequest("r", "POST", "/v1/chat/completions", api=Api.CHAT_COMPLETIONS, model=model,
                            prompt="".join(m["content"] for m in messages), body=body)  # fmt: skip


async def _close(producer: PrecisePrefixCacheProducer) -> None:
    # At once, before any loop turn: a subscriber closed before its sockets were ever read must not hang
    # in zmq's Context.term (it did while the monitor sockets were read by tasks).
    await asyncio.wait_for(producer.close(), 10)


def _counter(handle: Handle, name: str, **labels: str) -> float:
    return handle.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_the_local_tokenizer_gives_the_ids_the_index_is_looked_up_by(models: Path) -> None:
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    handle = Handle(Datastore(pods))
    producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", _tokenizing(models)), handle)
    try:
        messages = [{"role": "system", "content": "route well " * 10}, {"role": "user", "content": "hello world"}]
        request = _chat(messages)
        await producer.prepare_data(request)
        expected = ModelTokenizer.from_dir(models / "org" / "tiny").request_ids("chat_completions", request.body)
        ids = request.state[TOKENIZED_PROMPT]
        assert ids.tolist() == expected.tolist()
        # pod-a reports the prompt's blocks (ids as the engine computed them): it wins the precise match.
        n = len(ids) // BS
        producer.index.apply("127.0.0.1:8000", [BlockStored(list(range(1, n + 1)), None, ids[: n * BS].tolist(), BS)])
        producer.index.apply("127.0.0.2:8000", [])
        producer.produce(request, pods)
        match = request.state[PREFIX_MATCH]
        assert match.matched.get("pod-a") == n and "pod-b" not in match.matched
        # A LoRA adapter of the model uses the model's tokenizer; produce without prepare tokenizes inline.
        adapter = _chat(messages, model="tiny-adapter")
        producer.produce(adapter, pods)
        assert adapter.state[TOKENIZED_PROMPT].tolist() == ids.tolist()
    finally:
        await _close(producer)


async def test_a_request_whose_body_did_not_reach_the_plugin_is_counted_and_said(
    models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The failure --workers had before the body went to the owner (e9fd9a9): the request had a body, the plugin
    # got none, and routed approximately without a word. Now a fallback reason and a warning say so.
    handle = Handle(Datastore([]))
    producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", _tokenizing(models)), handle)
    try:
        request = dataclasses.replace(_chat([{"role": "user", "content": "hello"}]), body=b"", body_size=61)
        with caplog.at_level(logging.WARNING):
            await producer.prepare_data(request)
            producer.produce(dataclasses.replace(_chat([{"role": "user", "content": "again"}]), body=b"", body_size=61), [])
        assert TOKENIZED_PROMPT not in request.state
        assert _counter(handle, "epp_tokenize_fallbacks_total", reason="no_body") == 2
        (line,) = [r.getMessage() for r in caplog.records if "did not reach this plugin" in r.getMessage()]
        assert "a body of 61 bytes" in line  # once a minute: the second is counted, not said
        body_less = InferenceRequest("r", "GET", "/v1/models")  # no body to miss: nothing to say
        await producer.prepare_data(body_less)
        assert _counter(handle, "epp_tokenize_fallbacks_total", reason="no_body") == 2
    finally:
        await _close(producer)


async def test_a_large_prompt_is_tokenized_off_the_loop_and_a_timeout_falls_back(models: Path) -> None:
    handle = Handle(Datastore([]))
    producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", _tokenizing(models, timeout="1ns")), handle)
    try:
        messages = [{"role": "user", "content": "one two three " * 20_000}]
        request = _chat(messages)
        await producer.prepare_data(request)
        assert TOKENIZED_PROMPT not in request.state
        assert _counter(handle, "epp_tokenize_fallbacks_total", reason="timeout") == 1
        producer.produce(request, [])  # the approximate match stands; no second, inline attempt
        assert TOKENIZED_PROMPT not in request.state
    finally:
        await _close(producer)


@pytest.fixture
async def slow_engine() -> AsyncIterator[Endpoint]:
    async def tokenize(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response({"tokens": [1]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield Endpoint("pod-a", "127.0.0.1", port)
    finally:
        await runner.cleanup()


async def test_without_local_files_the_engine_is_asked_and_a_slow_one_is_cut_off(slow_engine: Endpoint) -> None:
    handle = Handle(Datastore([slow_engine]))
    parameters = PreciseParameters("p", {"indexerConfig": {"tokenizersPoolConfig": {
        "local": {"autoDiscoveryDir": "/nonexistent"},
        "remote": {"timeout": "20ms", "failureThreshold": 2, "cooldown": "1m"}}}})  # fmt: skip
    producer = PrecisePrefixCacheProducer("p", parameters, handle)
    try:
        for _ in range(5):
            request = _chat([{"role": "user", "content": "hi"}], model="m")
            await producer.prepare_data(request)
            assert TOKENIZED_PROMPT not in request.state
        assert _counter(handle, "epp_tokenize_fallbacks_total", reason="timeout") == 2
        assert _counter(handle, "epp_tokenize_fallbacks_total", reason="open") == 3
        assert _counter(handle, "epp_tokenize_duration_seconds_count", source="remote") == 2
        assert _counter(handle, "epp_tokenize_breaker_open") == 1
    finally:
        await _close(producer)


# A conversation's first turn, as the tests of a warm next turn begin it.
_TURN1 = [{"role": "system", "content": "route well " * 20}, {"role": "user", "content": "hello there " * 5}]


def _deferring(models: Path, pods: list[Endpoint], handle: Handle | None = None, **pool: object) -> PrecisePrefixCacheProducer:
    """A producer that may put a warm turn's new text off: told, as startup tells it of a config where no
    other plugin reads the token ids."""
    parameters = PreciseParameters("p", _tokenizing(models, **pool))
    producer = PrecisePrefixCacheProducer("p", parameters, handle or Handle(Datastore(pods)))
    producer.data_consumed(frozenset())
    return producer


def _two_pods(models: Path, pods: list[Endpoint]) -> tuple[PrecisePrefixCacheProducer, _Tokenization, ModelTokenizer]:
    """A deferring producer of ``pods``, its tokenization, and a tokenizer sharing no cache with it."""
    producer = _deferring(models, pods)
    assert producer.tokenization is not None
    return producer, producer.tokenization, ModelTokenizer.from_dir(models / "org" / "tiny")


def _holds(producer: PrecisePrefixCacheProducer, hostport: str, ids: np.ndarray) -> int:
    """``hostport``'s pod reports the full blocks of ``ids`` stored; returns how many."""
    n = len(ids) // BS
    producer.index.apply(hostport, [BlockStored(list(range(1, n + 1)), None, ids[: n * BS].tolist(), BS)])
    return n


async def test_a_warm_turns_new_text_is_encoded_after_the_answer(models: Path) -> None:
    """A conversation's next turn is looked up by the start its earlier turn left in the tokenizer's
    cache; the new message is encoded in pre_request (after the pick's answer), and the in-flight blocks
    and the ids are then the whole prompt's, exactly as encoding it first would give."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer = _deferring(models, pods)
    whole = ModelTokenizer.from_dir(models / "org" / "tiny")  # no cache shared with the producer's
    try:
        first = _TURN1
        request = _chat(first)
        await producer.prepare_data(request)
        assert producer.deferred == 0  # cold: encoded before the lookup
        _holds(producer, "127.0.0.1:8000", request.state[TOKENIZED_PROMPT])  # pod-a computed turn 1
        producer.index.apply("127.0.0.2:8000", [])

        second = [*first, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "route well " * 60}]
        request = _chat(second)
        await producer.prepare_data(request)
        assert TOKENIZED_PROMPT not in request.state  # the new message waits
        producer.produce(request, pods)
        ids = whole.request_ids("chat_completions", request.body)
        match = request.state[PREFIX_MATCH]
        assert producer.deferred == 1
        known = match.matched["pod-a"]  # all of the known start: turn 1's blocks
        assert 0 < known < len(ids) // BS and "pod-b" not in match.matched
        # The whole prompt's blocks, estimated at the known start's bytes per token (the same words here).
        assert abs(match.blocks - len(ids) // BS) <= 0.2 * (len(ids) // BS)
        assert PrefixCacheScorer().score(request, pods)[0] == pytest.approx(known / match.blocks)
        producer.pre_request(request, SchedulingResult({"default": [pods[0]]}, "default"))
        assert request.state[TOKENIZED_PROMPT].tolist() == ids.tolist()
        # The same prompt again (a retry, say) finds the rest in flight on pod-a; its cached end leaves
        # only the generation prompt to encode, which is done at once.
        again = _chat(second)
        await producer.prepare_data(again)
        assert again.state[TOKENIZED_PROMPT].tolist() == ids.tolist()
        producer.produce(again, pods)
        assert again.state[PREFIX_MATCH].matched == {"pod-a": len(ids) // BS}
        assert again.state[PREFIX_MATCH].blocks == len(ids) // BS
        assert producer.deferred == 1
    finally:
        await _close(producer)


async def test_a_plugin_that_consumes_the_token_ids_gets_them_before_the_pick(models: Path) -> None:
    """Told nothing (a producer built outside a config), or told that a plugin consumes them, the producer
    puts no ids off; told that none does, it may."""
    producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", _tokenizing(models)), Handle(Datastore([])))
    try:
        first = _TURN1
        await producer.prepare_data(_chat(first))
        for told, word in ((None, "more "), (frozenset({"tokenized-prompt", "x"}), "again ")):
            if told is not None:
                producer.data_consumed(told)  # as startup says for a consumer's declaration
            request = _chat([*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": word * 90}])
            await producer.prepare_data(request)
            assert len(request.state[TOKENIZED_PROMPT]) > 0
        producer.data_consumed(frozenset({"something-else"}))
        request = _chat([*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "then " * 90}])
        await producer.prepare_data(request)
        assert TOKENIZED_PROMPT not in request.state  # nobody else reads them before the pick: they may wait
    finally:
        await _close(producer)


def test_startup_tells_the_producer_whether_another_plugin_reads_the_token_ids(models: Path) -> None:
    class Reader:
        name = "reader"
        consumes = (TOKENIZED_PROMPT,)

        def score(self, request: InferenceRequest, candidates: list[Endpoint]) -> list[float]:
            return [0.0] * len(candidates)

    registry = default_registry()
    registry.register("ids-reader", lambda name, parameters, handle: Reader(), source="tests")
    parameters = json.dumps(_tokenizing(models))
    for extra, defers in (("", True), ("- type: ids-reader\n", False)):
        text = ("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
                f"- type: precise-prefix-cache-producer\n  parameters: {parameters}\n{extra}"
                "- type: prefix-cache-scorer\n- type: max-score-picker\n")  # fmt: skip
        config = load_config(text, registry, Handle(Datastore([])))
        producer = next(p for _, p in config.plugins.values() if isinstance(p, PrecisePrefixCacheProducer))
        assert producer.tokenization is not None and producer.tokenization.defer is defers


async def test_a_deferred_prompt_whose_ids_do_not_start_as_known_is_chained_whole(models: Path) -> None:
    """The reused start is what the ids start with unless the text proved unstable (then it is encoded
    whole, and may differ): the in-flight keys are then chained from the ids themselves."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000)]
    producer = _deferring(models, pods)
    try:
        first = _TURN1
        request = _chat(first)
        await producer.prepare_data(request)
        _holds(producer, "127.0.0.1:8000", request.state[TOKENIZED_PROMPT])
        request = _chat([*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more " * 90}])
        await producer.prepare_data(request)
        producer.produce(request, pods)
        deferred = request.state[_DEFERRED]
        ids = deferred.plan.finish()
        other = ids.copy()
        other[0] += 1  # as if the whole text had tokenized otherwise
        deferred.plan = Plan(0, lambda: other, deferred.known)
        producer.pre_request(request, SchedulingResult({"default": [pods[0]]}, "default"))
        assert request.state[TOKENIZED_PROMPT] is other
        last = chain_keys(other, BS, 0, len(other) // BS)[-1]  # every key of the chain differs from ids'
        assert dict(producer.in_flight.holders(last)).keys() == {"pod-a"}
        assert not producer.in_flight.holders(chain_keys(ids, BS, 0, len(ids) // BS)[-1])
    finally:
        await _close(producer)


async def test_a_warm_turn_whose_known_start_two_pods_hold_is_encoded_before_the_lookup(models: Path) -> None:
    """Both hold all the known start: the new text could tell them apart, so it is encoded at once."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer = _deferring(models, pods)
    try:
        first = _TURN1
        request = _chat(first)
        await producer.prepare_data(request)
        turn1 = request.state[TOKENIZED_PROMPT]
        second = [*first, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "and now " * 60}]
        request = _chat(second)
        await producer.prepare_data(request)
        _holds(producer, "127.0.0.1:8000", turn1)
        full = ModelTokenizer.from_dir(models / "org" / "tiny").request_ids("chat_completions", request.body)
        held = _holds(producer, "127.0.0.2:8000", full[: (len(turn1) // BS + 3) * BS])  # and 3 blocks more
        producer.produce(request, pods)
        assert producer.deferred == 0
        assert request.state[TOKENIZED_PROMPT].tolist() == full.tolist()
        match = request.state[PREFIX_MATCH]
        assert match.blocks == len(full) // BS
        assert match.matched == {"pod-a": len(turn1) // BS, "pod-b": held}
    finally:
        await _close(producer)


async def test_the_scheduler_awaits_prepare_data_and_isolates_its_failures(models: Path) -> None:
    class Broken:
        name = "broken"

        async def prepare_data(self, request: InferenceRequest) -> None:
            raise RuntimeError("boom")

    producer = PrecisePrefixCacheProducer("p", PreciseParameters("p", _tokenizing(models)), Handle(Datastore([])))
    scheduler = Scheduler(Profile("default", MaxScorePicker()), producers=[producer], hooks=[Broken(), producer])
    try:
        assert scheduler.prepares
        request = _chat([{"role": "user", "content": "hello"}])
        await scheduler.prepare(request)
        assert len(request.state[TOKENIZED_PROMPT]) > 0
    finally:
        await _close(producer)


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"hf": {"tokenizersCacheDir": "/tmp"}}, "hf must be null"),
        ({"uds": {"socketFile": "/tmp/t.sock"}}, "uds"),
        ({"timeout": "soon"}, "timeout"),
        ({"workersCount": 0}, "workersCount"),
        ({"local": {"autoDiscoveryDir": "/x", "typo": 1}}, "typo"),
        ({"remote": {"mode": "telepathy"}}, "mode"),
        ({"remote": {"url": "10.0.0.1:8000"}}, "url"),
        ({"minPrefixOverlapRatio": 2}, "minPrefixOverlapRatio"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_tokenizer_parameters_name_the_key(pool: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PreciseParameters("p", {"indexerConfig": {"tokenizersPoolConfig": pool}})


def test_broken_tokenizer_files_stop_startup_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        PrecisePrefixCacheProducer("p", PreciseParameters("p", {"indexerConfig": {"tokenizersPoolConfig": {
            "local": {"autoDiscoveryDir": str(tmp_path)}}}}))  # fmt: skip


async def test_a_long_cold_prompt_is_looked_up_by_its_head_and_encoded_after_the_answer_when_nobody_holds_it(
    models: Path,
) -> None:
    """Keys are chained: a pod that does not hold a prompt's first block matches none of it. So a long
    prompt the tokenizer has not seen is looked up by its head alone; when no pod holds the head's first
    block every match is 0, as a lookup by the whole ids would say, and the whole is encoded after the
    answer. A pod holding it (here: the prompt reached it without the picker) has it encoded at once."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer, tokenization, whole = _two_pods(models, pods)
    rng = random.Random(11)
    try:
        for pod in pods:
            producer.index.apply(pod.hostport, [])  # both publish; neither holds anything yet
        system = {"role": "system", "content": " ".join(rng.choice(("route", "well", "pods", "cache")) for _ in range(1800))}
        request = _chat([system, {"role": "user", "content": "first"}])
        await producer.prepare_data(request)
        assert TOKENIZED_PROMPT not in request.state
        producer.produce(request, pods)
        assert producer.deferred == 1 and not any(request.state[PREFIX_MATCH].matched.values())
        producer.pre_request(request, SchedulingResult({"default": [pods[1]]}, "default"))
        ids = whole.request_ids("chat_completions", request.body)
        keys = chain_keys(ids, BS, 0, len(ids) // BS)
        # Over 8 KiB: encoded on the worker threads. The head's blocks are in flight on pod-b at once...
        assert TOKENIZED_PROMPT not in request.state
        assert dict(producer.in_flight.holders(keys[0])).keys() == {"pod-b"}
        assert tokenization.pending_count() == 1
        await tokenization.settled()  # ...the rest's once its ids are back on the loop
        assert request.state[TOKENIZED_PROMPT].tolist() == ids.tolist()
        assert dict(producer.in_flight.holders(keys[-1])).keys() == {"pod-b"}

        other = _chat([{**system, "content": "said straight to a pod " + system["content"]}, {"role": "user", "content": "x"}])
        sent = whole.request_ids("chat_completions", other.body)
        held = _holds(producer, "127.0.0.1:8000", sent[: len(sent) // 2])  # half of it, bypassing the picker
        await producer.prepare_data(other)
        producer.produce(other, pods)
        assert producer.deferred == 1  # pod-a holds its first block: encoded before the pick, exact
        assert other.state[TOKENIZED_PROMPT].tolist() == sent.tolist()
        assert other.state[PREFIX_MATCH].matched == {"pod-a": held}
        assert producer.head_mismatches == 0
    finally:
        await _close(producer)


async def test_a_cold_prompt_too_long_for_the_loop_waits_for_the_answer_when_every_pod_says_nobody_holds_it(
    models: Path,
) -> None:
    """Over 16 KiB of text, a prompt is never encoded on the event loop. It used to be encoded on the threads
    before the pick; now, when every pool endpoint's events are followed and none holds (nor has in flight)
    its head's first block, it is looked up by its head and encoded after the answer. A pod holding that
    block, or a pod whose events are not followed, has it encoded before the pick, exact, as before."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer, tokenization, whole = _two_pods(models, pods)
    rng = random.Random(17)

    def prompt(lead: str) -> InferenceRequest:
        text = lead + " ".join(rng.choice(("route", "well", "pods", "cache", "blocks")) for _ in range(4000))
        assert len(text) > 16 << 10
        return _chat([{"role": "user", "content": text}])

    try:
        request = prompt("unfollowed ")  # pod-b has published nothing yet: not followed
        producer.index.apply("127.0.0.1:8000", [])
        await producer.prepare_data(request)
        assert TOKENIZED_PROMPT in request.state  # encoded before the pick

        producer.index.apply("127.0.0.2:8000", [])  # now both publish, neither holds anything
        request = prompt("nobody ")
        await producer.prepare_data(request)
        assert TOKENIZED_PROMPT not in request.state
        producer.produce(request, pods)
        assert producer.deferred == 1 and not any(request.state[PREFIX_MATCH].matched.values())
        producer.pre_request(request, SchedulingResult({"default": [pods[0]]}, "default"))
        await tokenization.settled()
        ids = whole.request_ids("chat_completions", request.body)
        assert request.state[TOKENIZED_PROMPT].tolist() == ids.tolist()
        keys = chain_keys(ids, BS, 0, len(ids) // BS)
        assert dict(producer.in_flight.holders(keys[-1])).keys() == {"pod-a"}

        request = prompt("held ")
        sent = whole.request_ids("chat_completions", request.body)
        held = _holds(producer, "127.0.0.2:8000", sent[: 40 * BS])  # its first blocks reached pod-b directly
        await producer.prepare_data(request)
        assert request.state[TOKENIZED_PROMPT].tolist() == sent.tolist()  # encoded before the pick
        producer.produce(request, pods)
        assert producer.deferred == 1 and request.state[PREFIX_MATCH].matched == {"pod-b": held}
    finally:
        await _close(producer)


async def test_a_rest_decided_too_long_for_the_loop_is_never_encoded_in_produce(models: Path) -> None:
    """prepare_data put a >16 KiB rest off; an event then brought a block size larger than the head, which
    leaves the head no key: produce still does not encode the rest on the loop (nothing is matched)."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer, tokenization, _ = _two_pods(models, pods)
    try:
        for pod in pods:
            producer.index.apply(pod.hostport, [])
        request = _cold(random.Random(37), 4000)
        await producer.prepare_data(request)
        assert request.state[_DEFERRED].decided
        producer.index.apply("127.0.0.1:8000", [BlockStored([1], None, list(range(4096)), 4096)])
        producer.produce(request, pods)
        assert TOKENIZED_PROMPT not in request.state and not request.state[PREFIX_MATCH].matched
        producer.pre_request(request, SchedulingResult({"default": [pods[0]]}, "default"))
        await tokenization.settled()
        assert len(request.state[TOKENIZED_PROMPT]) > 4096
    finally:
        await _close(producer)


async def test_blocks_stored_before_the_ids_come_back_from_the_threads_are_not_put_in_flight(models: Path) -> None:
    """A prompt encoded on the threads after the answer: its head's blocks are in flight on the pod picked
    at once, the rest's when its ids are back; what the pod's events stored meanwhile is not (in flight, it
    would stay there for the TTL however the pod evicts it)."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer, tokenization, whole = _two_pods(models, pods)
    rng = random.Random(23)
    try:
        for pod in pods:
            producer.index.apply(pod.hostport, [])
        text = " ".join(rng.choice(("route", "well", "pods", "cache")) for _ in range(2000))
        request = _chat([{"role": "system", "content": text}, {"role": "user", "content": "q"}])
        await producer.prepare_data(request)
        producer.produce(request, pods)
        producer.pre_request(request, SchedulingResult({"default": [pods[0]]}, "default"))
        ids = whole.request_ids("chat_completions", request.body)
        keys = chain_keys(ids, BS, 0, len(ids) // BS)
        stored = _holds(producer, "127.0.0.1:8000", ids[: len(ids) // 2])  # a quick prefill, before the ids
        assert not producer.in_flight.holders(keys[0])  # the events confirmed the head's blocks
        await tokenization.settled()
        assert not any(producer.in_flight.holders(key) for key in keys[:stored])
        assert all(dict(producer.in_flight.holders(key)).keys() == {"pod-a"} for key in keys[stored:])
    finally:
        await _close(producer)


def _cold(rng: random.Random, words: int, lead: str = "") -> InferenceRequest:
    text = lead + " ".join(rng.choice(("route", "well", "pods", "cache", "blocks")) for _ in range(words))
    return _chat([{"role": "user", "content": text}])


async def test_a_backlog_of_rests_after_the_answer_never_delays_an_encoding_a_pick_awaits(models: Path) -> None:
    """The rests put off to after the answer have threads of their own: with one thread each and that
    one stuck, a prompt that must be encoded before its pick (a pod holds its head) is encoded within
    the timeout all the same."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer = _deferring(models, pods, workersCount=1, timeout="2s")
    rng = random.Random(29)
    release = threading.Event()
    try:
        for pod in pods:
            producer.index.apply(pod.hostport, [])
        stuck = _cold(rng, 2000)
        await producer.prepare_data(stuck)
        producer.produce(stuck, pods)
        deferred = stuck.state[_DEFERRED]
        plan = deferred.plan
        assert plan.pending >= 8 << 10
        deferred.plan = Plan(plan.pending, lambda: release.wait(10) and plan.finish(), plan.known, plan.estimated,
                             plan.head)  # fmt: skip
        producer.pre_request(stuck, SchedulingResult({"default": [pods[0]]}, "default"))

        awaited = _cold(rng, 4000, "held ")
        ids = ModelTokenizer.from_dir(models / "org" / "tiny").request_ids("chat_completions", awaited.body)
        _holds(producer, "127.0.0.2:8000", ids[: 8 * BS])
        await producer.prepare_data(awaited)
        assert awaited.state[TOKENIZED_PROMPT].tolist() == ids.tolist()  # not timed out behind the stuck one
        assert TOKENIZED_PROMPT not in stuck.state
    finally:
        release.set()
        await _close(producer)


async def test_rests_beyond_the_backlog_are_not_encoded_and_counted(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    handle = Handle(Datastore(pods))
    producer = _deferring(models, pods, handle)
    tokenization = producer.tokenization
    assert tokenization is not None
    rng = random.Random(31)
    try:
        for pod in pods:
            producer.index.apply(pod.hostport, [])
        requests = [_cold(rng, words, f"{i} ") for i, words in enumerate((2000, 2600, 2000))]
        for request in requests:
            await producer.prepare_data(request)
            producer.produce(request, pods)
        pending = [r.state[_DEFERRED].plan.pending for r in requests]
        assert pending[2] < pending[1]
        monkeypatch.setattr(precise_module, "_BACKLOG_CHARS", pending[0] + pending[1] - 1)
        for request in requests:
            producer.pre_request(request, SchedulingResult({"default": [pods[0]]}, "default"))
        assert tokenization.backlog == pending[0] + pending[2]  # the second did not fit behind the first
        assert _counter(handle, "epp_tokenize_after_answer_backlog_bytes") == pending[0] + pending[2]
        await tokenization.settled()
        assert [TOKENIZED_PROMPT in r.state for r in requests] == [True, False, True]
        assert tokenization.backlog == 0 and _counter(handle, "epp_tokenize_after_answer_dropped") == 1
    finally:
        await _close(producer)


async def test_ids_that_fail_to_encode_before_the_pick_leave_the_approximate_match(models: Path) -> None:
    """Every pod publishes, so the approximate index was left out; the deferred text then failed to
    encode (the tokenizer refused it): the approximate match stands, as for any request without ids."""
    pods = [Endpoint("pod-a", "127.0.0.1", 8000), Endpoint("pod-b", "127.0.0.2", 8000)]
    producer = _deferring(models, pods)
    rng = random.Random(5)
    try:
        for pod in pods:
            producer.index.apply(pod.hostport, [])
        text = " ".join(rng.choice(("route", "well", "pods")) for _ in range(700))
        request = _chat([{"role": "system", "content": text}, {"role": "user", "content": "q"}])
        await producer.prepare_data(request)
        deferred = request.state[_DEFERRED]
        _holds(producer, "127.0.0.1:8000", deferred.known)  # a pod holds its head: encoded before the pick...
        producer._finish = lambda r, d: None  # type: ignore[method-assign]  # ...which the tokenizer refuses
        producer.produce(request, pods)
        match = request.state[PREFIX_MATCH]
        assert match.block_tokens == producer.parameters.approximate.block_size_tokens  # the approximate one
    finally:
        await _close(producer)
