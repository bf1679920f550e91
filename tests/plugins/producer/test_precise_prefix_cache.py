"""precise-prefix-cache-producer against the simulator's publisher: events route a prompt sent straight to a
pod (bypassing the picker) back to that pod; pods that publish nothing keep the approximate match."""

from __future__ import annotations

import asyncio
import socket

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import PREFIX_MATCH, Endpoint, Handle, InferenceRequest
from epp.plugins.producer.precise_prefix_cache import PreciseParameters, PrecisePrefixCacheProducer
from epp.plugins.scorer.prefix_cache import PrefixCacheScorer
from epp.sim.kvevents import KVEventPublisher

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
