"""Table-driven tests of approx-prefix-cache-producer and prefix-cache-scorer: affinity of a
prompt family to the pod that served it, model and salt separation, pods leaving the pool,
autoTune capacities, metrics, and parameter validation (upstream spellings included)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from epp.datalayer.datastore import Datastore
from epp.framework import PREFIX_MATCH as MATCH
from epp.framework import Endpoint, Handle, InferenceRequest, PluginMetrics, SchedulingResult
from epp.plugins.producer.approx_prefix_cache import ApproxPrefixCacheProducer, PrefixParameters
from epp.plugins.scorer.prefix_cache import PrefixCacheScorer
from tests.plugins._helpers import pod

TOKENS = 4  # blockSizeTokens in most tests: a block is 16 characters


SMALL = PrefixParameters.parse("p", {"blockSizeTokens": TOKENS})


# Three prompt families: a 10-block system prompt each, then a question.
SYSTEM = {name: (name * 16)[:16] * 10 for name in ("alpha-", "beta--", "gamma-")}


def ask(prompt: str, *, model: str = "m", salt: str | None = None) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers={}, model=model, prompt=prompt, cache_salt=salt)


def picked(endpoint: Endpoint) -> SchedulingResult:
    return SchedulingResult({"p": [endpoint]}, "p")


def serve(producer: ApproxPrefixCacheProducer, request: InferenceRequest, candidates: Sequence[Endpoint], to: Endpoint) -> None:
    """What the scheduler does around a pick: produce, (score, pick: given), pre_request."""
    producer.produce(request, candidates)
    producer.pre_request(request, picked(to))


def scores(producer: ApproxPrefixCacheProducer, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
    producer.produce(request, candidates)
    return PrefixCacheScorer().score(request, candidates)


PODS = [pod(i) for i in range(4)]


@pytest.mark.parametrize(
    ("history", "query", "expected"),
    [
        # (prompt served, pod index) in order; then the query; then each pod's score.
        pytest.param([], SYSTEM["alpha-"] + "q1", [0.0, 0.0, 0.0, 0.0], id="nothing-recorded"),
        pytest.param([(SYSTEM["alpha-"] + "first question?.", 2)], SYSTEM["alpha-"] + "another question", [0.0, 0.0, 10 / 11, 0.0], id="family-sticks-to-its-pod"),
        pytest.param([(SYSTEM["alpha-"] + "x" * 32, 1)], SYSTEM["alpha-"] + "x" * 32, [0.0, 1.0, 0.0, 0.0], id="exact-repeat"),
        pytest.param(
            [(SYSTEM["alpha-"] + "q" * 16, 0), (SYSTEM["beta--"] + "q" * 16, 1), (SYSTEM["gamma-"] + "q" * 16, 3)],
            SYSTEM["beta--"] + "r" * 16,
            [0.0, 10 / 11, 0.0, 0.0],
            id="three-families-three-pods",
        ),
        pytest.param(
            [(SYSTEM["alpha-"][:80], 0), (SYSTEM["alpha-"], 1)],
            SYSTEM["alpha-"] + "z" * 16,
            [5 / 11, 10 / 11, 0.0, 0.0],
            id="the-longer-prefix-scores-higher",
        ),
        pytest.param([(SYSTEM["alpha-"], 0)], "short", [0.0, 0.0, 0.0, 0.0], id="prompt-shorter-than-a-block"),
        pytest.param([(SYSTEM["alpha-"], 0)], "y" * 16 + SYSTEM["alpha-"], [0.0, 0.0, 0.0, 0.0], id="same-text-later-is-no-prefix"),
    ],
)
def test_a_prompt_family_scores_highest_on_the_pod_that_served_it(history: list[tuple[str, int]], query: str, expected: list[float]) -> None:
    producer = ApproxPrefixCacheProducer(parameters=SMALL)
    for prompt, index in history:
        serve(producer, ask(prompt), PODS, PODS[index])
    assert scores(producer, ask(query), PODS) == pytest.approx(expected)


def test_only_the_candidates_are_scored_but_every_pod_is_matched() -> None:
    producer = ApproxPrefixCacheProducer(parameters=SMALL)
    serve(producer, ask(SYSTEM["alpha-"]), PODS, PODS[3])
    request = ask(SYSTEM["alpha-"])
    assert scores(producer, request, PODS[:2]) == [0.0, 0.0]
    assert request.state[MATCH].matched == {"pod-3": 10}


@pytest.mark.parametrize(
    ("served", "query", "expected"),
    [
        (("m", None), ("m", None), 1.0),
        (("m", None), ("m", ""), 1.0),  # an empty salt is no salt (upstream)
        (("m", None), ("other-model", None), 0.0),
        (("m", "tenant-a"), ("m", "tenant-a"), 1.0),
        (("m", "tenant-a"), ("m", "tenant-b"), 0.0),
        (("m", "tenant-a"), ("m", None), 0.0),
        (("m", None), ("m", "tenant-a"), 0.0),
    ],
)
def test_model_and_salt_keep_caches_apart(served: tuple[str, str | None], query: tuple[str, str | None], expected: float) -> None:
    producer = ApproxPrefixCacheProducer(parameters=SMALL)
    serve(producer, ask(SYSTEM["gamma-"], model=served[0], salt=served[1]), PODS, PODS[1])
    result = scores(producer, ask(SYSTEM["gamma-"], model=query[0], salt=query[1]), PODS)
    assert result == [0.0, expected, 0.0, 0.0]


def test_pods_leaving_the_pool_are_cleaned_out_of_the_index() -> None:
    datastore = Datastore(PODS)
    producer = ApproxPrefixCacheProducer("p", SMALL, Handle(datastore))
    assert sorted(producer.index.endpoints()) == ["pod-0", "pod-1", "pod-2", "pod-3"]  # registered as they join
    serve(producer, ask(SYSTEM["alpha-"]), PODS, PODS[1])
    serve(producer, ask(SYSTEM["beta--"]), PODS, PODS[2])
    assert producer.index.endpoint_size("pod-1") == 10 and producer.index.size == 20
    datastore.upsert(pod(2, labels={"role": "decode"}))  # a re-label: the same pod stays
    datastore.remove("pod-1")
    assert "pod-1" not in producer.index and producer.index.size == 10
    assert scores(producer, ask(SYSTEM["alpha-"]), list(datastore.endpoints())) == [0.0, 0.0, 0.0]
    assert scores(producer, ask(SYSTEM["beta--"]), list(datastore.endpoints())) == [0.0, 1.0, 0.0]
    datastore.upsert(pod(9))
    assert "pod-9" in producer.index


@pytest.mark.parametrize(
    ("parameters", "cache_tokens", "capacity"),
    [
        ({}, None, 31250),  # no num_gpu_blocks scraped yet: lruCapacityPerServer
        ({}, 16 * 800, 800),  # autoTune (on by default): the pod's num_gpu_blocks
        ({"autoTune": False}, 16 * 800, 31250),
        ({"autoTune": False, "lruCapacityPerServer": 500}, 16 * 800, 500),
        ({"lruCapacityPerServer": 500}, None, 500),
    ],
)
def test_capacity_per_pod(parameters: dict[str, Any], cache_tokens: int | None, capacity: int) -> None:
    endpoint = pod(0, cache_tokens=cache_tokens)
    producer = ApproxPrefixCacheProducer("p", PrefixParameters.parse("p", parameters), Handle(Datastore([endpoint])))
    assert producer.index.capacity("pod-0") == capacity  # set when the pod joined the pool
    serve(producer, ask("w" * 640), [endpoint], endpoint)
    assert producer.index.capacity("pod-0") == capacity


def test_autotune_follows_the_pods_cache_size_and_evicts_past_it() -> None:
    endpoint = pod(0)  # not scraped yet: the default capacity
    producer = ApproxPrefixCacheProducer("p", SMALL, Handle(Datastore([endpoint])))
    prompt = SYSTEM["alpha-"] + "tail" * 40  # 20 blocks
    serve(producer, ask(prompt), [endpoint], endpoint)
    assert producer.index.endpoint_size("pod-0") == 20
    scraped = pod(0, cache_tokens=16 * 2)  # 2 of the pod's 16-token blocks: 8 of the index's 4-token ones
    serve(producer, ask(prompt), [scraped], scraped)
    assert producer.index.capacity("pod-0") == 8
    assert producer.index.endpoint_size("pod-0") == 8  # the prompt's first 8 blocks
    assert scores(producer, ask(prompt), [scraped]) == [8 / 20]


def _geometry(block_size: int | None, num_gpu_blocks: int | None, size_tokens: int | None = None) -> Endpoint:
    endpoint = pod(0)
    metrics = replace(endpoint.metrics, block_size=block_size, num_gpu_blocks=num_gpu_blocks, kv_cache_size_tokens=size_tokens)
    return replace(endpoint, metrics=metrics)


@pytest.mark.parametrize(
    ("block_size", "num_gpu_blocks", "size_tokens", "capacity"),
    [
        # issue 13: vLLM on CPU uses 128-token blocks; N of them hold N x 8 of the index's 16-token blocks
        (128, 1000, None, 8000),
        (128, 23, None, 184),
        (16, 1000, None, 1000),
        (8, 1000, None, 500),
        # vLLM's own count of its cache in tokens wins over blocks x block size (hybrid models differ)
        (128, 1000, 64_000, 4000),
        (None, None, 64_000, 4000),
        # blocks of an unknown size: taken as the index's own (what there is to go by)
        (None, 1000, None, 1000),
        (None, None, None, 31250),
    ],
)
def test_autotune_capacity_is_the_pods_cache_in_the_index_blocks(
    block_size: int | None, num_gpu_blocks: int | None, size_tokens: int | None, capacity: int
) -> None:
    endpoint = _geometry(block_size, num_gpu_blocks, size_tokens)
    producer = ApproxPrefixCacheProducer("p", PrefixParameters(), Handle(Datastore([endpoint])))
    assert producer.index.capacity("pod-0") == capacity
    serve(producer, ask("w" * 640), [endpoint], endpoint)
    assert producer.index.capacity("pod-0") == capacity


def test_a_128_token_block_pod_keeps_what_it_holds_in_the_index() -> None:
    # 23 blocks of 128 tokens hold 2,944 tokens (issue 13's figure): the index keeps 184 of its blocks
    endpoint = _geometry(128, 23)
    producer = ApproxPrefixCacheProducer("p", PrefixParameters(), Handle(Datastore([endpoint])))
    first = "first prompt " * 1000  # 13,000 characters: 203 blocks of 64 characters
    serve(producer, ask(first), [endpoint], endpoint)
    assert producer.index.endpoint_size("pod-0") == 184
    assert scores(producer, ask(first), [endpoint]) == [pytest.approx(184 / 203)]


def test_the_match_is_capped_at_max_prefix_tokens() -> None:
    producer = ApproxPrefixCacheProducer(parameters=PrefixParameters.parse("p", {"blockSizeTokens": TOKENS, "maxPrefixTokensToMatch": 5 * TOKENS}))
    serve(producer, ask(SYSTEM["alpha-"]), PODS, PODS[0])
    request = ask(SYSTEM["alpha-"] + "anything after the cap")
    assert scores(producer, request, PODS[:1]) == [1.0]
    assert request.state[MATCH].blocks == 5 and producer.index.size == 5


def test_metrics_size_bytes_and_the_hit_ratio_of_each_pick() -> None:
    registry = CollectorRegistry()
    endpoint = pod(0)
    producer = ApproxPrefixCacheProducer("p", SMALL, Handle(Datastore([endpoint]), metrics=PluginMetrics(registry)))
    serve(producer, ask(SYSTEM["alpha-"] + "q" * 16), [endpoint], endpoint)  # nothing held: 0
    serve(producer, ask(SYSTEM["alpha-"] + "r" * 16), [endpoint], endpoint)  # 10 of 11 held
    value = registry.get_sample_value
    assert value("inference_extension_prefix_indexer_size") == 12
    assert value("epp_prefix_indexer_bytes") == producer.index.nbytes > 0
    assert value("inference_extension_prefix_indexer_hit_ratio_count") == 2
    assert value("inference_extension_prefix_indexer_hit_ratio_sum") == pytest.approx(10 / 11)
    assert value("inference_extension_prefix_indexer_hit_ratio_bucket", {"le": "0.0"}) == 1


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        ({}, (16, 131072, 31250, True)),
        ({"blockSizeTokens": 32, "maxPrefixTokensToMatch": 4096, "lruCapacityPerServer": 1000, "autoTune": False}, (32, 4096, 1000, False)),
        ({"blockSize": 64}, (16, 131072, 31250, True)),  # upstream's older spelling, in characters
        ({"hashBlockSize": 128}, (32, 131072, 31250, True)),  # llm-d's, in characters
        ({"blockSize": 2}, (1, 131072, 31250, True)),  # under a token: one token
        ({"maxPrefixBlocksToMatch": 100}, (16, 1600, 31250, True)),  # blocks × blockSizeTokens
        ({"blockSizeTokens": 8, "maxPrefixBlocksToMatch": 10}, (8, 80, 31250, True)),
    ],
)
def test_parameters(parameters: dict[str, Any], expected: tuple) -> None:
    p = PrefixParameters.parse("prefix", parameters)
    assert (p.block_size_tokens, p.max_prefix_tokens, p.lru_capacity_per_server, p.auto_tune) == expected
    assert p.block_chars == 4 * p.block_size_tokens and p.max_blocks == max(1, p.max_prefix_tokens // p.block_size_tokens)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"blockSizeTokens": 16, "blockSize": 64}, "give one of blockSizeTokens, blockSize, hashBlockSize"),
        ({"blockSize": 64, "hashBlockSize": 64}, "give one of blockSizeTokens, blockSize, hashBlockSize"),
        ({"maxPrefixTokensToMatch": 100, "maxPrefixBlocksToMatch": 5}, "give one of maxPrefixTokensToMatch, maxPrefixBlocksToMatch"),
        ({"blockSizeTokens": 0}, "blockSizeTokens must be an integer ≥ 1, got 0"),
        ({"blockSizeTokens": True}, "blockSizeTokens must be an integer ≥ 1, got True"),
        ({"hashBlockSize": "64"}, "hashBlockSize must be an integer ≥ 1, got '64'"),
        ({"maxPrefixBlocksToMatch": -1}, "maxPrefixBlocksToMatch must be an integer ≥ 1"),
        ({"lruCapacityPerServer": 1.5}, "lruCapacityPerServer must be an integer ≥ 1, got 1.5"),
        ({"autoTune": "yes"}, "autoTune must be true or false, got 'yes'"),
        ({"blockSizeTokenz": 16}, r"unknown parameter\(s\) \['blockSizeTokenz'\]"),
    ],
)
def test_bad_parameters_are_refused_naming_the_plugin(parameters: dict[str, Any], message: str) -> None:
    for factory in (ApproxPrefixCacheProducer.from_config, PrefixCacheScorer.from_config):
        with pytest.raises(ValueError, match=f"^my-prefix: .*{message}"):
            factory("my-prefix", parameters, Handle(Datastore()))
