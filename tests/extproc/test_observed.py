"""Observed responses at the protocol level: the routing stream's token, the observer taking over the
request, and what happens without one (epp/extproc/processor.py, "Observed responses")."""

from __future__ import annotations

import asyncio

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

import epp.extproc.processor as processor_module
from epp.envoy.bootstrap import OBSERVE_NAMESPACE, OBSERVED_HEADER
from epp.extproc.processor import ExternalProcessor
from epp.framework import Outcome
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import RequestMetrics
from tests.doubles import WireStream
from tests.extproc.test_processor import COMPLETION, POST, Mode, _SpyDirector, body, headers

_OBSERVED = {OBSERVED_HEADER.encode(): b"true"}
_USAGE = b'{"id":"c","choices":[{"text":"hi"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}'


class _Setup:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.director = _SpyDirector()
        self.processor = ExternalProcessor(self.director, RequestMetrics(), max_request_body_bytes=100_000)  # type: ignore[arg-type]
        self.finishes: list[tuple[RoutedRequest, Outcome]] = []
        real = RoutedRequest.finish

        def counted(routed: RoutedRequest, outcome: Outcome = "complete") -> None:
            if not routed._finished:
                self.finishes.append((routed, outcome))
            real(routed, outcome)

        monkeypatch.setattr(RoutedRequest, "finish", counted)

    async def route(self, wire: WireStream) -> str:
        """Route one completion on ``wire`` (response body mode NONE, as the observing bootstrap has
        it) and half-close it as Envoy does; the token its routing answer carried."""
        call = self.processor.open(wire)  # type: ignore[arg-type]
        message = headers(POST, mode=Mode.FULL_DUPLEX_STREAMED)
        message.protocol_config.response_body_mode = Mode.NONE
        call.message(message.SerializeToString())
        call.message(body(COMPLETION, end_of_stream=True).SerializeToString())
        await asyncio.sleep(0)
        answer = wire.sent[0]
        token = answer.dynamic_metadata.fields[OBSERVE_NAMESPACE].struct_value.fields["request"].string_value
        assert answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields  # the destination, as ever
        call.half_close()
        return token


def _observed(message: pb.ProcessingRequest, token: str) -> bytes:
    message.observability_mode = True
    message.metadata_context.filter_metadata[OBSERVE_NAMESPACE].fields["request"].string_value = token
    return message.SerializeToString()


def _response_headers(content_type: str) -> pb.ProcessingRequest:
    pairs = [(":status", "200"), ("content-type", content_type)]
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
        )
    )


async def test_the_observer_takes_the_routed_request_over_and_answers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _Setup(monkeypatch)
    routing = WireStream(_OBSERVED)
    token = await setup.route(routing)
    assert routing.status == (0, "")  # Envoy ended the routing stream, the picker ended its side...
    assert setup.finishes == []  # ...and the request is still in flight: its response has not started
    assert routing.idled
    observer = WireStream()
    call = setup.processor.open(observer)  # type: ignore[arg-type]
    call.message(_observed(headers(POST), token))  # Envoy's observer opens with the request's headers
    call.message(_observed(_response_headers("application/json"), token))
    call.message(_observed(pb.ProcessingRequest(response_body=pb.HttpBody(body=_USAGE[:40])), token))
    assert setup.finishes == []
    call.message(_observed(pb.ProcessingRequest(response_body=pb.HttpBody(body=_USAGE[40:], end_of_stream=True)), token))
    await asyncio.sleep(0)
    assert observer.sent == []  # Envoy reads no answer on an observing stream
    assert observer.status == (0, "")  # ended by the picker at the response's end
    ((routed, outcome),) = setup.finishes
    assert outcome == "complete"
    assert routed is setup.director.routed[0]
    assert routed.usage == (5, 7) and routed.response_bytes == len(_USAGE)
    assert routed.first_byte_after is not None


async def test_an_observer_whose_token_names_nothing_here_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _Setup(monkeypatch)
    observer = WireStream()
    call = setup.processor.open(observer)  # type: ignore[arg-type]
    call.message(_observed(headers(POST), "0123456789abcdef01234567"))  # another replica's, or before a restart
    await asyncio.sleep(0)
    assert observer.status == (0, "") and observer.sent == []
    assert setup.finishes == []


async def test_a_routed_stream_with_no_observer_finishes_its_request_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processor_module, "OBSERVER_WAIT", 0.05)
    setup = _Setup(monkeypatch)
    await setup.route(WireStream(_OBSERVED))
    assert setup.finishes == []
    await asyncio.sleep(0.2)
    assert [outcome for _, outcome in setup.finishes] == ["complete"]  # as its own stream ended
    # An observer coming later (its process was slow) finds nothing: the request is not finished twice.
    assert len(setup.processor._observed) == 0


async def test_without_an_observer_announced_the_routed_stream_finishes_at_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _Setup(monkeypatch)
    await setup.route(WireStream())
    assert [outcome for _, outcome in setup.finishes] == ["complete"]
    assert len(setup.processor._observed) == 0  # its token is forgotten with it


async def test_an_observed_response_whose_stream_closes_before_its_end_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _Setup(monkeypatch)
    token = await setup.route(WireStream(_OBSERVED))
    observer = WireStream()
    call = setup.processor.open(observer)  # type: ignore[arg-type]
    call.message(_observed(headers(POST), token))
    call.message(_observed(_response_headers("text/event-stream"), token))
    call.message(_observed(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n")), token))
    call.half_close()  # Envoy's deferred close: the client went away before the response's end
    await asyncio.sleep(0)
    assert [outcome for _, outcome in setup.finishes] == ["cancelled"]


# -- another process's part (--workers: epp.server.workers extends Observed) -----------------------


async def test_a_routed_request_taken_by_another_process_is_never_finished_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processor_module, "OBSERVER_WAIT", 0.05)
    setup = _Setup(monkeypatch)
    token = await setup.route(WireStream(_OBSERVED))
    setup.processor._observed.taken(token)  # (a worker: the owner's Claimed, for a sibling's claim)
    assert len(setup.processor._observed) == 0
    await asyncio.sleep(0.2)
    assert setup.finishes == []  # the other process finishes it, with its response
    setup.processor._observed.taken(token)  # told twice, or about a request ended here: nothing
    observer = WireStream()
    call = setup.processor.open(observer)  # type: ignore[arg-type]
    call.message(_observed(headers(POST), token))  # an observer here after all: nothing to take over
    await asyncio.sleep(0)
    assert observer.status == (0, "") and setup.finishes == []


class _Claimed:
    """A request another process routed, as the observing process's stream sees it (RemoteRouted's methods)."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def response_headers(self, headers: dict[str, str]) -> None:
        self.events.append(headers[":status"])

    def response_body_started(self) -> None:
        self.events.append("started")

    def response_ended(self, size: int, usage: tuple[int, int] | None) -> None:
        self.events.append((size, usage))

    def finish(self, outcome: str = "complete") -> None:
        self.events.append(outcome)


class _Sibling(processor_module.Observed):
    __slots__ = ("claims", "request")

    def __init__(self) -> None:
        super().__init__()
        self.claims: list[str] = []
        self.request = _Claimed()

    def claim(self, token: str) -> RoutedRequest | None:
        self.claims.append(token)
        return self.request if token.startswith("sibling") else None  # type: ignore[return-value]


async def test_an_observer_of_a_request_another_process_routed_claims_it_and_accounts_its_response() -> None:
    observed = _Sibling()
    processor = ExternalProcessor(_SpyDirector(), RequestMetrics(), max_request_body_bytes=100_000, observed=observed)  # type: ignore[arg-type]
    token = "sibling-0000000000000007"
    observer = WireStream()
    call = processor.open(observer)  # type: ignore[arg-type]
    call.message(_observed(headers(POST), token))
    call.message(_observed(_response_headers("application/json"), token))
    call.message(_observed(pb.ProcessingRequest(response_body=pb.HttpBody(body=_USAGE, end_of_stream=True)), token))
    await asyncio.sleep(0)
    assert observed.claims == [token]  # claimed once, by its first message
    assert observed.request.events == ["200", "started", (len(_USAGE), (5, 7)), "complete"]
    assert observer.sent == [] and observer.status == (0, "")
    other = WireStream()
    processor.open(other).message(_observed(headers(POST), "elsewhere-00000000000007"))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert other.status == (0, "") and observed.claims[-1] == "elsewhere-00000000000007"  # nothing to claim: ended
