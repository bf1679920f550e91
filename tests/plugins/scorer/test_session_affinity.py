"""session-affinity-scorer: llm-d's encoded-endpoint x-session-token header."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle, Profile, WeightedScorer
from epp.plugins.picker.max_score import MaxScorePicker
from epp.plugins.scorer.queue import QueueScorer
from epp.plugins.scorer.session_affinity import SessionAffinityScorer, decode_token, encode_token
from epp.scheduling.runner import Scheduler
from tests.plugins._helpers import pod, request

HANDLE = Handle(Datastore())


def test_token_is_standard_base64_of_the_endpoint_name() -> None:
    # Upstream's token for the pod "default/vllm-0" is base64("default/vllm-0").
    assert encode_token("default/vllm-0") == "ZGVmYXVsdC92bGxtLTA="
    assert decode_token("ZGVmYXVsdC92bGxtLTA=") == "default/vllm-0"
    assert encode_token("10.0.0.1:8000") == base64.b64encode(b"10.0.0.1:8000").decode()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"x-session-token": encode_token("pod-1")}, [0.0, 1.0, 0.0]),
        ({"x-session-token": encode_token("pod-2")}, [0.0, 0.0, 1.0]),
        ({}, [0.0, 0.0, 0.0]),  # no session yet
        ({"x-session-token": encode_token("pod-9")}, [0.0, 0.0, 0.0]),  # its endpoint is gone
        ({"x-session-token": "not base64!"}, [0.0, 0.0, 0.0]),
        ({"x-session-token": "cG9kLTE"}, [0.0, 0.0, 0.0]),  # "pod-1" unpadded: invalid, as in Go
        ({"x-session-token": base64.b64encode(b"\xff\xfe").decode()}, [0.0, 0.0, 0.0]),  # not UTF-8
        ({"x-session-token": "pod-1"}, [0.0, 0.0, 0.0]),  # the bare name is not a token
        ({"x-other": encode_token("pod-1")}, [0.0, 0.0, 0.0]),
    ],
)
def test_the_endpoint_the_token_names_scores_one(headers: dict[str, str], expected: list[float]) -> None:
    candidates = [pod(0), pod(1), pod(2)]
    assert SessionAffinityScorer().score(request(headers=headers), candidates) == expected


def test_a_stale_session_endpoint_scores_zero() -> None:
    candidates = [pod(0), pod(1, stale=True)]
    assert SessionAffinityScorer().score(request(headers={"x-session-token": encode_token("pod-1")}), candidates) == [0.0, 0.0]


def test_response_carries_the_token_of_the_endpoint_that_served() -> None:
    scorer = SessionAffinityScorer()
    # Whatever token the request carried: the response names where it actually went.
    stale_token = request(headers={"x-session-token": encode_token("pod-0")})
    assert scorer.response_received(stale_token, pod(2), {":status": "200"}) == {"x-session-token": encode_token("pod-2")}


def test_a_configured_header_name_is_read_and_written_lower_case() -> None:
    scorer = SessionAffinityScorer.from_config("s", {"headerName": "X-My-Session"}, HANDLE)
    assert scorer.response_received(request(), pod(1), {}) == {"x-my-session": encode_token("pod-1")}
    assert scorer.score(request(headers={"x-my-session": encode_token("pod-1")}), [pod(0), pod(1)]) == [0.0, 1.0]
    assert scorer.score(request(headers={"x-session-token": encode_token("pod-1")}), [pod(0), pod(1)]) == [0.0, 0.0]


def test_a_session_sticks_through_the_scheduler_against_a_mild_load_difference() -> None:
    scheduler = Scheduler(
        Profile(
            "default",
            MaxScorePicker(),
            scorers=(WeightedScorer(SessionAffinityScorer(), 2.0), WeightedScorer(QueueScorer(), 1.0)),
        ),
        hooks=[SessionAffinityScorer()],
    )
    pods = [pod(0, queue=0), pod(1, queue=5)]
    first = request()
    assert scheduler.schedule(first, pods)[0].name == "pod-0"
    token = scheduler.response_received(first, pods[1], {})  # say it was served by pod-1 after all
    assert token == {"x-session-token": encode_token("pod-1")}
    for _ in range(10):
        assert scheduler.schedule(request(headers=token), pods)[0].name == "pod-1"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"headerName": ""}, "non-empty string"),
        ({"headerName": 5}, "non-empty string"),
        ({"headerName": "bad header"}, "not a valid HTTP header name"),
        ({"algorithm": "session_id_header"}, "not implemented"),
        ({"algorithm": "sticky"}, "not supported"),
        ({"profileName": "prefill"}, "profileName is not supported"),
        ({"evictionTtlSeconds": 600}, "session_id_header algorithm is not implemented"),
        ({"maxAge": 0}, "unknown parameter"),
    ],
)
def test_refuses_bad_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SessionAffinityScorer.from_config("s", parameters, HANDLE)


def test_from_config_defaults() -> None:
    scorer = SessionAffinityScorer.from_config("s", {"algorithm": "encoded_endpoint_header"}, HANDLE)
    assert scorer.header_name == "x-session-token" and scorer.name == "s"
