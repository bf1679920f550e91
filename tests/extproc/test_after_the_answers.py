"""What the picker does after its answers, on a real connection: a pick's ``pre_request`` hooks and a
stream's accounting run once the read's answers are written, and never out of order with the next pick.

Driven in memory (:mod:`tests.wire.rawh2`): Envoy's bytes go to a :class:`~epp.wire.http2.Connection`
serving the real :class:`ExternalProcessor` over a director with the default profile (the approximate
prefix producer's ``pre_request`` adds each prompt's blocks to its index).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client import CollectorRegistry

from epp.datalayer.datastore import Datastore
from epp.extproc.processor import ExternalProcessor
from epp.framework import PREFIX_MATCH, Endpoint, Handle, PluginMetrics
from epp.requestcontrol.director import Director
from epp.requestcontrol.lifecycle import RoutedRequest
from epp.requestcontrol.metrics import RequestMetrics
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from tests.extproc.test_processor import POST, body, headers
from tests.wire.rawh2 import PATH, Loopback, data, grpc, rst_stream

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # isort: skip

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
PROMPT = json.dumps({"model": "m", "prompt": "the same long prompt " * 40}).encode()


class Setup:
    """A connection serving ext_proc, and a log of what ran when (with the writes made by then)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        datastore = Datastore([Endpoint(f"pod-{i}", f"10.0.2.{i}", 8000) for i in range(2)])
        built = load_config(None, default_registry(), Handle(datastore, metrics=PluginMetrics(CollectorRegistry())))
        self.scheduler = built.scheduler
        self.director = director = Director(datastore, built.scheduler, RequestMetrics())
        processor = ExternalProcessor(director, RequestMetrics(), max_request_body_bytes=1 << 20)
        self.loop = Loopback({PATH: processor.open})
        self.log: list[tuple[str, str, int]] = []  # (what, request id, transport writes by then)
        self.picks: dict[str, tuple[int, dict[str, int], str]] = {}  # request id -> its prompt's blocks, the
        # blocks its pick found each pod holding, the pod picked
        run, pre_request, finish = self.scheduler.run, self.scheduler.pre_request, RoutedRequest.finish
        complete = self.scheduler.response_complete

        def spied_run(request: Any, *args: Any) -> Any:
            self.log.append(("pick", request.request_id, self.writes))
            result = run(request, *args)
            match = request.state[PREFIX_MATCH]
            self.picks[request.request_id] = (match.blocks, dict(match.matched), result.endpoints[0].name)
            return result

        def spied_pre_request(request: Any, result: Any) -> None:
            self.log.append(("pre_request", request.request_id, self.writes))
            pre_request(request, result)

        def spied_finish(routed: RoutedRequest, outcome: str) -> None:
            self.log.append(("finish", routed.request.request_id, self.writes))
            finish(routed, outcome)

        def spied_complete(request: Any, endpoint: Any, outcome: str) -> None:
            self.log.append((f"complete {outcome}", request.request_id, self.writes))
            complete(request, endpoint, outcome)

        monkeypatch.setattr(self.scheduler, "response_complete", spied_complete)
        monkeypatch.setattr(self.scheduler, "run", spied_run)
        monkeypatch.setattr(self.scheduler, "pre_request", spied_pre_request)
        monkeypatch.setattr(RoutedRequest, "finish", spied_finish)

    @property
    def writes(self) -> int:
        return self.loop.transport.writes

    def request(self, stream_id: int, request_id: str) -> bytes:
        """Envoy's bytes for a whole request: its stream's headers, the request headers and the body."""
        message = headers({**POST, "x-request-id": request_id}, mode=FULL_DUPLEX).SerializeToString()
        return (
            self.loop.requests.open(stream_id, PATH)
            + data(stream_id, grpc(message))
            + data(stream_id, grpc(body(PROMPT, end_of_stream=True).SerializeToString()))
        )

    def response(self, stream_id: int) -> bytes:
        """Envoy's bytes for a whole non-streamed response: its headers and its one body chunk."""
        first = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
        first.response_headers.headers.headers.add(key=":status", raw_value=b"200")
        last = pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"usage": {}}', end_of_stream=True))
        return data(stream_id, grpc(first.SerializeToString())) + data(stream_id, grpc(last.SerializeToString()))

    def answers(self, stream_id: int) -> list[pb.ProcessingResponse]:
        return [pb.ProcessingResponse.FromString(m) for m in self.loop.response(stream_id).messages]


@pytest.fixture
async def setup(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Setup]:
    yield Setup(monkeypatch)


async def test_a_pick_s_hooks_run_after_its_answer_is_written(setup: Setup) -> None:
    before = setup.writes
    setup.loop.send(setup.request(1, "r1"))
    assert setup.writes == before + 1  # the read's one write
    assert setup.log == [("pick", "r1", before), ("pre_request", "r1", before + 1)]
    assert setup.answers(1)[0].request_headers.response.header_mutation.set_headers  # the destination


async def test_a_pick_that_waited_runs_its_hooks_after_its_answer_is_written_too(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    route = setup.director.route

    async def waiting(*args: Any, **kwargs: Any) -> RoutedRequest:
        await asyncio.sleep(0)  # (admission's queue, a tokenizer's thread): the route goes on in a task
        return await route(*args, **kwargs)

    monkeypatch.setattr(setup.director, "route", waiting)
    before = setup.writes
    setup.loop.send(setup.request(1, "r1"))
    assert setup.log == [] and setup.writes == before  # no answer in the read
    for _ in range(3):
        await asyncio.sleep(0)
    assert setup.log == [("pick", "r1", before), ("pre_request", "r1", before + 1)]
    setup.loop.pump()
    assert setup.answers(1)[0].request_headers.response.header_mutation.set_headers


async def test_the_next_pick_in_the_same_read_runs_after_the_hooks_of_the_one_before(setup: Setup) -> None:
    before = setup.writes
    setup.loop.send(setup.request(1, "r1") + setup.request(3, "r2"))
    assert setup.writes == before + 1  # both answers in one write
    assert setup.log == [
        ("pick", "r1", before),
        ("pre_request", "r1", before),  # before r2's pick, so that r2 sees r1's blocks...
        ("pick", "r2", before),
        ("pre_request", "r2", before + 1),  # ...and the last one after the write
    ]
    # r2's pick saw r1's blocks in the index: the whole prompt, on r1's pod.
    blocks, _, first = setup.picks["r1"]
    assert blocks > 1 and setup.picks["r2"][1] == {first: blocks}


async def test_a_stream_s_accounting_runs_after_its_last_answer_is_written(setup: Setup) -> None:
    setup.loop.send(setup.request(1, "r1"))
    before = setup.writes
    setup.loop.send(setup.response(1))
    assert setup.writes == before + 1
    assert setup.log[-2:] == [("finish", "r1", before + 1), ("complete complete", "r1", before + 1)]
    assert setup.loop.response(1).status == 0  # the stream ended OK, its last answer first
    assert setup.answers(1)[-1].response_body.response.body_mutation.streamed_response.end_of_stream


async def test_a_stream_reset_in_the_read_that_routed_it_ends_its_request_after_the_pick_s_hooks(setup: Setup) -> None:
    setup.loop.send(setup.request(1, "r1") + rst_stream(1, 8))  # Envoy's client went away at once (CANCEL)
    # The end (finish, logged as it starts) runs the pick's hooks before the end's own hooks.
    assert [(what, rid) for what, rid, _ in setup.log] == [
        ("pick", "r1"), ("finish", "r1"), ("pre_request", "r1"), ("complete cancelled", "r1")
    ]
