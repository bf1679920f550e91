"""precise-prefix-cache-producer against the simulator's publisher: events route a prompt sent straight to a
pod (bypassing the picker) back to that pod; pods that publish nothing keep the approximate match."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.framework import PREFIX_MATCH, Api, Endpoint, Handle, InferenceRequest, Profile
from epp.plugins.picker.max_score import MaxScorePicker
from epp.plugins.producer.precise_prefix_cache import TOKENIZED_PROMPT, PreciseParameters, PrecisePrefixCacheProducer
from epp.plugins.scorer.prefix_cache import PrefixCacheScorer
from epp.prefix.kvwire import BlockStored
from epp.prefix.tokenize import ModelTokenizer
from epp.scheduling.runner import Scheduler
from epp.sim.kvevents import KVEventPublisher
from epp.testing.tokenizer import write_tokenizer_dir

BS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ask(prompt: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", model="m", prompt=prompt)


def _tokens(request: InferenceRequest) -> list[int]:
    return [ord(c) for c in request.prompt]  # a stand-in tokenizer: one token per character


async def test_a_prompt_sent_straight_to_a_pod_is_routed_to_it() -> None:
    port = _free_port()
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
    # One loop turn first: KVEventSubscriber.close hangs in zmq's Context.term when a pod's monitor task
    # was cancelled before it ever ran (its finally never closes the monitor socket): kvsubscriber's bug.
    await asyncio.sleep(0.01)
    await producer.close()


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
    with pytest.raises(ValueError, match="tokenizer.json"):
        PrecisePrefixCacheProducer("p", PreciseParameters("p", {"indexerConfig": {"tokenizersPoolConfig": {
            "local": {"autoDiscoveryDir": str(tmp_path)}}}}))  # fmt: skip
