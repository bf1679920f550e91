"""A worker's director and the owner's side of its channel (epp.requestcontrol.remote / owner / ipc),
both ends in this process over a real socketpair: what crosses, in what order, and what happens
when either end goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.errors import EppError, Reason, Refusal
from epp.extproc.models import models_answer
from epp.extproc.processor import ExternalProcessor
from epp.framework import Api, Endpoint, InferenceRequest
from epp.requestcontrol import ipc
from epp.requestcontrol import owner as owner_module
from epp.requestcontrol.director import Director
from epp.requestcontrol.owner import WorkerRequests
from epp.requestcontrol.remote import RemoteDirector, RemoteMetrics, RemoteRouted
from epp.requestcontrol.tracing import Tracing
from epp.scheduling.runner import Scheduler
from tests.doubles import WireStream
from tests.requestcontrol.test_director import POD, Stack, config

OTHER = Endpoint("pod-b", "10.0.0.2", 8000)


@dataclass
class Pair:
    """A worker's director and the owner's requests, joined by a socketpair on this loop."""

    remote: RemoteDirector
    owner: WorkerRequests
    worker_channel: ipc.Channel
    owner_channel: ipc.Channel
    lost: list[str]

    async def kill_worker(self) -> None:
        """The worker process dies: its end of the socket closes."""
        assert self.worker_channel.transport is not None
        self.worker_channel.transport.abort()
        for _ in range(50):
            if "owner saw the worker go" in self.lost:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the owner never noticed")

    async def kill_owner(self) -> None:
        assert self.owner_channel.transport is not None
        self.owner_channel.transport.abort()
        for _ in range(50):
            if "worker saw the owner go" in self.lost:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the worker never noticed")


async def connect(
    director: Director,
    *,
    wait_for_headers: bool = False,
    send_body: bool = False,
    siblings: dict[str, WorkerRequests] | None = None,
    prefix: str = "",
    claimed: list[int] | None = None,
) -> Pair:
    """``siblings``, ``prefix``: the workers by their tokens' prefix, where this one goes under ``prefix``
    (observed responses); ``claimed`` collects the ids of the owner's :class:`ipc.Claimed` messages."""
    loop = asyncio.get_running_loop()
    owner_end, worker_end = socket.socketpair()
    lost: list[str] = []
    remote = RemoteDirector(wait_for_headers=wait_for_headers, send_body=send_body)
    owner = WorkerRequests(director, lambda m: None, siblings=siblings)
    if siblings is not None:
        siblings[prefix] = owner

    def owner_lost() -> None:
        owner.lost()
        lost.append("owner saw the worker go")

    def worker_lost() -> None:
        remote.owner_lost()
        lost.append("worker saw the owner go")

    owner_channel = ipc.Channel(ipc.owner_decoder, owner.handlers(), owner_lost)
    handlers = remote.handlers()
    if claimed is not None:
        handlers[ipc.Claimed] = lambda message: claimed.append(message.id)
    worker_channel = ipc.Channel(ipc.worker_decoder, handlers, worker_lost)
    await loop.create_unix_connection(lambda: owner_channel, sock=owner_end)
    await loop.create_unix_connection(lambda: worker_channel, sock=worker_end)
    owner.send, owner.post, owner.after_sent = owner_channel.send, owner_channel.post, owner_channel.after_flush
    remote.send, remote.post = worker_channel.send, worker_channel.post
    return Pair(remote, owner, worker_channel, owner_channel, lost)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    yield Stack(config(flow_control=False, max_concurrency=100), endpoints=(POD, OTHER))


def request(prompt: str = "hello", request_id: str = "r1", **headers: str) -> InferenceRequest:
    return InferenceRequest(
        request_id=request_id, method="POST", path="/v1/completions", headers=headers, model="m", prompt=prompt
    )


def in_flight(stack: Stack) -> int:
    return sum(e.inflight.requests for e in stack.datastore.endpoints())


def sample(stack: Stack, name: str, labels: Mapping[str, str]) -> float:
    return stack.metrics.registry.get_sample_value(name, dict(labels)) or 0.0


async def until(condition: Any, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting until {what}")


# -- a request's life across the two processes -------------------------------------------------


async def test_the_pick_is_the_owners_and_the_response_events_reach_its_request(stack: Stack) -> None:
    pair = await connect(stack.director)
    routed = await pair.remote.route(request())
    assert isinstance(routed, RemoteRouted)
    assert routed.destination in (POD.hostport, OTHER.hostport)
    assert routed.primary.name in (POD.name, OTHER.name)
    assert in_flight(stack) == 1  # counted in the owner from the pick on
    assert routed.response_headers({":status": "200", "content-type": "application/json"}) is None  # nothing waits
    routed.response_body_started()
    routed.response_ended(123, (7, 5))
    routed.finish("complete")
    await until(lambda: in_flight(stack) == 0, "the owner finished the request")
    model = {"model_name": "m", "target_model_name": "m"}
    assert sample(stack, "inference_objective_input_tokens_sum", model) == 7
    assert sample(stack, "inference_objective_output_tokens_sum", model) == 5
    assert sample(stack, "inference_objective_response_sizes_sum", model) == 123
    assert sample(stack, "epp_request_time_to_first_byte_seconds_count", model) == 1
    assert sample(stack, "inference_objective_running_requests", {"model_name": "m"}) == 0
    assert pair.owner.requests == 1 and pair.owner.in_flight == 0


@pytest.mark.parametrize("send_body", [True, False])
async def test_the_body_reaches_the_owners_request_when_a_plugin_reads_it(
    stack: Stack, send_body: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tokenizer (precise-prefix-cache-producer) reads request.body in the owner, where it routes: with
    # --workers the body must travel with the request; for a configuration that reads no body, it need not.
    pair = await connect(stack.director, send_body=send_body)
    seen: list[bytes] = []
    real_route = stack.director.route

    async def route(request: InferenceRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append(request.body)
        return await real_route(request, *args, **kwargs)

    monkeypatch.setattr(stack.director, "route", route)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}]}'
    routed = await pair.remote.route(dataclasses.replace(request(), body=body))
    routed.finish("cancelled")
    assert seen == [body if send_body else b""]


# What the owner works out itself (the director from the headers and the pool), and the per-request state
# plugins fill there: every other field of the edge's request must travel in ipc.Route.
_DERIVED_IN_THE_OWNER = {"adapter", "objective", "priority", "state"}


async def test_the_owners_request_has_every_field_the_edge_parsed(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    # A field added to InferenceRequest and not carried would be silently empty where plugins run (as the body
    # was, e9fd9a9): this fails until it is carried or named above.
    pair = await connect(stack.director, send_body=True)
    seen: list[InferenceRequest] = []
    real_route = stack.director.route

    async def route(request: InferenceRequest, *args: Any, **kwargs: Any) -> Any:
        seen.append(request)
        return await real_route(request, *args, **kwargs)

    monkeypatch.setattr(stack.director, "route", route)
    edge = InferenceRequest(
        request_id="r-all", method="POST", path="/v1/chat/completions", headers={"x-test": "1"}, api=Api.CHAT_COMPLETIONS,
        model="m", prompt="hello", stream=True, cache_salt="salt", max_tokens=7, body_size=64, body=b'{"x": 1}',
    )  # fmt: skip
    routed = await pair.remote.route(edge)
    routed.finish("cancelled")
    (owners,) = seen
    carried = {f.name for f in dataclasses.fields(InferenceRequest)} - _DERIVED_IN_THE_OWNER
    different = {name for name in carried if getattr(owners, name) != getattr(edge, name)}
    assert not different, {name: (getattr(edge, name), getattr(owners, name)) for name in different}
    defaults = InferenceRequest("", "", "")
    assert all(getattr(edge, name) != getattr(defaults, name) for name in carried), "set every carried field"


async def test_a_5xx_response_is_finished_as_an_error_with_its_status_carried_by_the_last_event(
    stack: Stack,
) -> None:
    pair = await connect(stack.director)
    seen: list[str] = []
    real_finish = stack.director.scheduler.response_complete
    stack.director.scheduler.response_complete = lambda r, e, outcome: seen.append(outcome)  # type: ignore[method-assign]
    try:
        routed = await pair.remote.route(request())
        routed.response_headers({":status": "500"})  # no body: the status travels with Finish
        routed.finish("complete")
        await until(lambda: seen, "the owner finished the request")
    finally:
        stack.director.scheduler.response_complete = real_finish  # type: ignore[method-assign]
    assert seen == ["error"]


async def test_events_of_many_requests_keep_their_order_and_nothing_stays_in_flight(stack: Stack) -> None:
    pair = await connect(stack.director)
    routed = await asyncio.gather(*(pair.remote.route(request(f"prompt {i}", f"r{i}")) for i in range(40)))
    assert in_flight(stack) == 40
    for i, one in enumerate(reversed(routed)):  # finished in another order than routed
        one.response_headers({":status": "200"})
        if i % 2:
            one.response_body_started()
            one.response_ended(10, None)
        one.finish("complete" if i % 3 else "cancelled")
        if i % 7 == 0:
            await asyncio.sleep(0)  # some in the same frame, some not
    await until(lambda: in_flight(stack) == 0, "every request finished")
    assert pair.owner.in_flight == 0
    assert sample(stack, "inference_objective_running_requests", {"model_name": "m"}) == 0


async def test_a_batch_of_messages_sent_in_one_turn_is_one_frame(stack: Stack) -> None:
    pair = await connect(stack.director)
    before = pair.worker_channel.sent_frames
    routing = [asyncio.ensure_future(pair.remote.route(request(f"p{i}"))) for i in range(10)]
    await asyncio.gather(*routing)
    assert pair.worker_channel.sent_frames - before == 1  # ten routes, one write
    assert pair.owner_channel.sent_frames == 1  # ten answers, one write
    for routed in routing:
        routed.result().finish("cancelled")


async def test_the_owner_runs_the_picks_hooks_after_the_frame_with_their_answers_and_each_pick_after_the_last_s(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = await connect(stack.director)
    log: list[tuple[str, str, int]] = []
    scheduler = stack.director.scheduler
    run, pre_request = scheduler.run, scheduler.pre_request

    def spied_run(r: InferenceRequest, *args: Any) -> Any:
        log.append(("pick", r.request_id, pair.owner_channel.sent_frames))
        return run(r, *args)

    def spied_pre_request(r: InferenceRequest, result: Any) -> None:
        log.append(("pre_request", r.request_id, pair.owner_channel.sent_frames))
        pre_request(r, result)

    monkeypatch.setattr(scheduler, "run", spied_run)
    monkeypatch.setattr(scheduler, "pre_request", spied_pre_request)
    routing = [asyncio.ensure_future(pair.remote.route(request(f"p{i}", f"r{i}"))) for i in range(2)]  # one frame
    for routed in await asyncio.gather(*routing):
        routed.finish("cancelled")
    assert log == [("pick", "r0", 0), ("pre_request", "r0", 0), ("pick", "r1", 0), ("pre_request", "r1", 1)]


async def test_work_after_a_frame_runs_once_it_is_written_in_order_and_a_failure_is_logged(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    pair = await connect(stack.director)
    channel, ran = pair.owner_channel, []
    channel.after_flush(lambda: ran.append(("alone", channel.sent_frames)))  # nothing waits: at once
    channel.send(ipc.Models(None))
    channel.after_flush(lambda: 1 / 0)
    channel.after_flush(lambda: ran.append(("after", channel.sent_frames)))
    assert ran == [("alone", 0)]
    with caplog.at_level(logging.ERROR, logger="epp.requestcontrol.ipc"):
        await asyncio.sleep(0)  # the turn's end: the frame, then the work
    assert ran == [("alone", 0), ("after", 1)]
    assert any("work after a frame" in r.getMessage() for r in caplog.records)


async def test_posted_events_wait_for_company_or_go_alone_soon(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    pair = await connect(stack.director)
    monkeypatch.setattr(ipc, "LAZY_DELAY", 3600.0)
    routed = await pair.remote.route(request())
    frames = pair.worker_channel.sent_frames
    routed.response_body_started()  # posted: no frame at the end of this turn
    for _ in range(5):
        await asyncio.sleep(0)
    assert pair.worker_channel.sent_frames == frames
    another = await pair.remote.route(request("another"))  # an urgent message takes the posted one along
    assert pair.worker_channel.sent_frames == frames + 1
    monkeypatch.setattr(ipc, "LAZY_DELAY", 0.01)
    routed.finish("complete")
    another.finish("complete")
    await until(lambda: in_flight(stack) == 0, "both finished")  # alone, LAZY_DELAY later
    assert pair.worker_channel.sent_frames == frames + 2


# -- refusals ---------------------------------------------------------------------------------


async def test_an_owner_refusal_is_raised_in_the_worker_as_the_same_error(stack: Stack) -> None:
    pair = await connect(stack.director)
    with pytest.raises(EppError) as excinfo:
        await pair.remote.route(request(), subset=["10.9.9.9:8000"])
    assert excinfo.value.reason is Reason.NO_ENDPOINT
    assert "subset hint" in excinfo.value.message
    assert pair.owner.in_flight == 0


async def test_a_shed_request_keeps_its_status_and_dropped_reason_header() -> None:
    stack = Stack(config(flow_control=False, max_concurrency=1))
    pair = await connect(stack.director)
    first = await pair.remote.route(request(**{"x-llm-d-inference-objective": "batch"}))
    with pytest.raises(EppError) as excinfo:
        await pair.remote.route(request(**{"x-llm-d-inference-objective": "batch"}))
    error = excinfo.value
    assert (error.refusal, error.status) == (Refusal.REJECTED_SATURATED, 429)
    assert dict(error.headers) == {"x-llm-d-request-dropped-reason": "rejected-saturated"}
    first.finish("complete")


async def test_refusals_the_worker_answers_are_counted_once_in_the_owner(stack: Stack) -> None:
    pair = await connect(stack.director)
    metrics = RemoteMetrics(pair.worker_channel.post)
    metrics.refused(EppError(Reason.BAD_REQUEST, "not JSON"))
    metrics.refused(EppError(Refusal.REJECTED_SATURATED, "busy"), "m")
    await until(
        lambda: sample(stack, "epp_requests_total", {"outcome": "shed"}) == 1, "the owner counted the refusals"
    )
    assert sample(stack, "epp_requests_total", {"outcome": "bad_request"}) == 1
    labels = {"model_name": "m", "target_model_name": "m", "error_code": "shed"}
    assert sample(stack, "inference_objective_request_error_total", labels) == 1


# -- cancellation -----------------------------------------------------------------------------


async def test_a_stream_cancelled_while_queued_in_flow_control_leaves_the_owners_queue() -> None:
    stack = Stack(config(flow_control=True, max_concurrency=1))
    pair = await connect(stack.director)
    first = await pair.remote.route(request("first"))
    waiting = asyncio.ensure_future(pair.remote.route(request("second")))
    await until(lambda: stack.admission.queued == 1, "the second request queued in the owner")
    waiting.cancel()  # the client went away (the edge cancels the stream's task)
    await until(lambda: stack.admission.queued == 0, "the owner dropped it from the queue")
    assert stack.sample("llm_d_epp_flow_control_requests_total", outcome="EvictedContextCancelled", priority="0") == 1
    assert pair.owner.in_flight == 1  # only the first
    first.finish("complete")
    await until(lambda: pair.owner.in_flight == 0, "the first finished")
    assert in_flight(stack) == 0


async def test_a_cancel_that_crosses_the_pick_finishes_the_pick_cancelled(stack: Stack) -> None:
    pair = await connect(stack.director)
    assert pair.worker_channel.transport is not None
    pair.worker_channel.transport.pause_reading()  # the answer waits in the socket...
    routing = asyncio.ensure_future(pair.remote.route(request()))
    await until(lambda: in_flight(stack) == 1, "the owner routed it")
    routing.cancel()  # ...when the stream goes away
    pair.worker_channel.transport.resume_reading()
    with pytest.raises(asyncio.CancelledError):
        await routing
    await until(lambda: in_flight(stack) == 0, "the owner finished the pick")
    assert pair.owner.in_flight == 0
    assert pair.remote.waiting == 0


async def test_a_request_queued_when_its_worker_dies_leaves_the_queue() -> None:
    stack = Stack(config(flow_control=True, max_concurrency=1))
    pair = await connect(stack.director)
    first = await pair.remote.route(request("first"))
    second = asyncio.ensure_future(pair.remote.route(request("second")))
    await until(lambda: stack.admission.queued == 1, "the second request queued")
    await pair.kill_worker()
    second.cancel()
    await until(lambda: stack.admission.queued == 0, "the queue emptied")
    assert in_flight(stack) == 0  # the first, routed, was finished as an error
    assert pair.owner.in_flight == 0
    del first


# -- observed responses: a request routed by one worker, its response observed by another ----------

A, B = "0123abcd0001", "0123abcd0002"  # two workers' token prefixes (ipc.TOKEN_PREFIX characters)


async def test_a_claimed_request_is_finished_by_the_observing_worker_and_the_router_is_told(stack: Stack) -> None:
    siblings: dict[str, WorkerRequests] = {}
    told_a: list[int] = []
    a = await connect(stack.director, siblings=siblings, prefix=A, claimed=told_a)
    b = await connect(stack.director, siblings=siblings, prefix=B)
    routed = await a.remote.route(request())
    observed = b.remote.claim(ipc.worker_token(A, routed.id))
    await until(lambda: told_a == [routed.id], "the routing worker was told")
    assert (a.owner.in_flight, b.owner.in_flight, a.owner.claimed) == (0, 1, 1)  # the request moved to b
    assert in_flight(stack) == 1
    observed.response_headers({":status": "200"})
    observed.response_body_started()
    observed.response_ended(40, (3, 9))
    observed.finish("complete")
    routed.finish("cancelled")  # (a routing worker that was not told yet: ignored, the request is b's)
    await until(lambda: in_flight(stack) == 0, "the observing worker finished the request")
    model = {"model_name": "m", "target_model_name": "m"}
    assert sample(stack, "inference_objective_output_tokens_sum", model) == 9
    assert sample(stack, "epp_request_time_to_first_byte_seconds_count", model) == 1
    assert sample(stack, "inference_objective_request_duration_seconds_count", model) == 1  # complete, once


@pytest.mark.parametrize(
    "case", ["unknown worker", "this worker's own", "finished already", "not hex", "its worker restarted"]
)
async def test_a_claim_that_names_no_request_of_another_worker_is_logged_and_its_events_ignored(
    stack: Stack, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    owner_module._unclaimed_limit.reset()  # (the test before may have logged one)
    siblings: dict[str, WorkerRequests] = {}
    a = await connect(stack.director, siblings=siblings, prefix=A)
    b = await connect(stack.director, siblings=siblings, prefix=B)
    routed = await a.remote.route(request())
    token = ipc.worker_token(A, routed.id)
    if case == "unknown worker":
        token = ipc.worker_token("0123abcd0009", routed.id)
    elif case == "this worker's own":
        token = ipc.worker_token(B, routed.id)
    elif case == "finished already":
        routed.finish("complete")
        await until(lambda: in_flight(stack) == 0, "finished")
    elif case == "not hex":
        token = A + "zz" * 6
    else:
        await a.kill_worker()  # (a restarted worker has another prefix)
        del siblings[A]
    observed = b.remote.claim(token)
    observed.response_body_started()
    observed.finish("complete")
    await until(lambda: "no other worker holds" in caplog.text, "the claim was logged")
    await asyncio.sleep(ipc.LAZY_DELAY * 3)
    assert b.owner.in_flight == 0 and a.owner.claimed == 0
    if case not in ("finished already", "its worker restarted"):
        assert a.owner.in_flight == 1  # still the routing worker's, to finish after its wait
        routed.finish("cancelled")
    await until(lambda: in_flight(stack) == 0, "finished")


async def test_a_claimed_request_whose_observing_worker_dies_is_finished_as_an_error(stack: Stack) -> None:
    siblings: dict[str, WorkerRequests] = {}
    a = await connect(stack.director, siblings=siblings, prefix=A)
    b = await connect(stack.director, siblings=siblings, prefix=B)
    routed = await a.remote.route(request())
    b.remote.claim(ipc.worker_token(A, routed.id))
    await until(lambda: b.owner.in_flight == 1, "claimed")
    await b.kill_worker()
    assert in_flight(stack) == 0 and a.owner.in_flight == 0


# -- either end going away --------------------------------------------------------------------


async def test_when_the_worker_dies_the_owner_finishes_its_requests_as_errors(stack: Stack) -> None:
    pair = await connect(stack.director)
    outcomes: list[str] = []
    real = stack.director.scheduler.response_complete
    stack.director.scheduler.response_complete = lambda r, e, outcome: outcomes.append(outcome)  # type: ignore[method-assign]
    try:
        routed = [await pair.remote.route(request(f"p{i}")) for i in range(3)]
        routed[0].response_body_started()
        await asyncio.sleep(ipc.LAZY_DELAY * 3)
        assert in_flight(stack) == 3
        await pair.kill_worker()
    finally:
        stack.director.scheduler.response_complete = real  # type: ignore[method-assign]
    assert outcomes == ["error"] * 3
    assert in_flight(stack) == 0
    assert sum(e.inflight.unanswered for e in stack.datastore.endpoints()) == 0
    assert sample(stack, "inference_objective_running_requests", {"model_name": "m"}) == 0


async def test_when_the_owner_dies_waiting_routes_fail_and_later_ones_are_refused() -> None:
    stack = Stack(config(flow_control=True, max_concurrency=1))
    pair = await connect(stack.director)
    await pair.remote.route(request("first"))
    waiting = asyncio.ensure_future(pair.remote.route(request("second")))
    await until(lambda: stack.admission.queued == 1, "queued")
    await pair.kill_owner()
    with pytest.raises(RuntimeError, match="routing process stopped"):
        await waiting
    with pytest.raises(EppError) as excinfo:
        await pair.remote.route(request("third"))
    assert excinfo.value.reason is Reason.INTERNAL


# -- response headers set by plugins' hooks ------------------------------------------------------


class _SetsAHeader:
    name = "sets-a-header"

    def response_received(self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]) -> Any:
        return {"x-served-by": f"{endpoint.name} after {headers.get(':status')}"}


async def test_with_a_response_received_hook_the_worker_waits_for_the_owners_headers(stack: Stack) -> None:
    stack.director.scheduler = Scheduler(stack.director.scheduler.profile, hooks=[_SetsAHeader()])
    pair = await connect(stack.director, wait_for_headers=True)
    routed = await pair.remote.route(request())
    later = routed.response_headers({":status": "200"})
    assert isinstance(later, asyncio.Future)
    added = await asyncio.wait_for(later, 5)
    assert added == {"x-served-by": f"{routed.primary.name} after 200"}
    routed.finish("complete")
    await until(lambda: in_flight(stack) == 0, "finished")


async def test_a_header_wait_cancelled_by_the_stream_leaves_nothing_behind(stack: Stack) -> None:
    pair = await connect(stack.director, wait_for_headers=True)
    routed = await pair.remote.route(request())
    later = routed.response_headers({":status": "200"})
    assert isinstance(later, asyncio.Future)
    later.cancel()
    routed.finish("cancelled")
    await until(lambda: in_flight(stack) == 0, "finished")
    assert not pair.remote._headers


# -- what the worker answers from its own copy ---------------------------------------------------


async def test_get_v1_models_is_answered_from_the_union_the_owner_pushed() -> None:
    remote = RemoteDirector()
    assert models_answer(remote.datastore.endpoints()) is None  # nothing pushed yet: routed to a pod
    cards = [{"id": "base", "object": "model", "parent": None}, {"id": "lora", "object": "model", "parent": "base"}]
    remote._models(ipc.Models(cards))
    answer = models_answer(remote.datastore.endpoints())
    assert answer is not None
    assert json.loads(answer.immediate_response.body) == {"object": "list", "data": cards}


def test_a_route_message_is_decoded_into_the_same_request_fields() -> None:
    message = ipc.Route(
        5, "r", "POST", "/v1/chat/completions", {"x": "y"}, "chat_completions", "m", "p" * 10, True, "salt", 7, 99,
        ["10.0.0.1:8000"], None,
    )  # fmt: skip
    frame = msgspec.msgpack.encode([message])
    assert ipc.owner_decoder.decode(frame) == [message]


async def test_a_frame_that_arrives_in_pieces_is_decoded_whole(stack: Stack) -> None:
    pair = await connect(stack.director)
    big = "x" * 3_000_000  # several socket buffers
    routed = await pair.remote.route(request(big))
    assert routed.request.prompt == big
    assert in_flight(stack) == 1
    routed.finish("complete")
    await until(lambda: in_flight(stack) == 0, "finished")


# -- the edge over a remote director (the processor's hook for a later headers answer) ----------


def _headers_message(pairs: dict[str, str], *, response: bool = False, end_of_stream: bool = False) -> bytes:
    fields = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=fields), end_of_stream=end_of_stream)
    if response:
        return pb.ProcessingRequest(response_headers=headers).SerializeToString()
    return pb.ProcessingRequest(request_headers=headers).SerializeToString()


def _body_message(data: bytes, *, response: bool = False, end_of_stream: bool = False) -> bytes:
    body = pb.HttpBody(body=data, end_of_stream=end_of_stream)
    if response:
        return pb.ProcessingRequest(response_body=body).SerializeToString()
    return pb.ProcessingRequest(request_body=body).SerializeToString()


async def test_the_edge_waits_for_the_hooks_headers_and_answers_the_chunks_behind_them_in_order(stack: Stack) -> None:
    stack.director.scheduler = Scheduler(stack.director.scheduler.profile, hooks=[_SetsAHeader()])
    pair = await connect(stack.director, wait_for_headers=True)
    processor = ExternalProcessor(pair.remote, RemoteMetrics(pair.worker_channel.post), max_request_body_bytes=10_000)  # type: ignore[arg-type]
    wire = WireStream()
    call = processor.open(wire)  # type: ignore[arg-type]
    call.message(_headers_message({":method": "POST", ":path": "/v1/completions", "x-request-id": "r1"}))
    call.message(_body_message(json.dumps({"model": "m", "prompt": "hello"}).encode(), end_of_stream=True))
    await until(lambda: len(wire.sent) == 2, "the routing answers")
    assert pair.worker_channel.transport is not None
    pair.worker_channel.transport.pause_reading()  # the owner's headers answer waits in the socket
    call.message(_headers_message({":status": "200"}, response=True))
    call.message(_body_message(b"first", response=True))
    call.message(_body_message(b"last", response=True, end_of_stream=True))
    await asyncio.sleep(0.05)
    assert len(wire.sent) == 2  # nothing answered before the headers
    pair.worker_channel.transport.resume_reading()
    await until(lambda: wire.status is not None, "the stream ended")
    headers_answer, first, last = wire.sent[2:]
    (option,) = headers_answer.response_headers.response.header_mutation.set_headers
    assert option.header.key == "x-served-by"
    assert option.header.raw_value.decode() in (f"{POD.name} after 200", f"{OTHER.name} after 200")
    assert first.response_body.response.body_mutation.streamed_response.body == b"first"
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    assert wire.status == (0, "")
    await until(lambda: in_flight(stack) == 0, "the owner finished the request")


async def test_a_bad_body_in_a_worker_is_refused_there_and_counted_in_the_owner(stack: Stack) -> None:
    pair = await connect(stack.director)
    processor = ExternalProcessor(pair.remote, RemoteMetrics(pair.worker_channel.post), max_request_body_bytes=10_000)  # type: ignore[arg-type]
    wire = WireStream()
    call = processor.open(wire)  # type: ignore[arg-type]
    call.message(_headers_message({":method": "POST", ":path": "/v1/completions"}))
    call.message(_body_message(b"{not json", end_of_stream=True))
    await until(lambda: wire.status is not None, "the answer")
    assert wire.sent[-1].immediate_response.status.code == 400
    await until(lambda: sample(stack, "epp_requests_total", {"outcome": "bad_request"}) == 1, "the owner counted it")
    assert pair.owner.requests == 0  # never routed


# -- tracing across the two processes --------------------------------------------------------------


async def test_the_owners_spans_join_the_workers_trace_under_its_orchestration_span(stack: Stack) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    environ = {"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "always_on"}
    worker_tracing, owner_tracing = Tracing(environ), Tracing(environ)
    worker_spans, owner_spans = InMemorySpanExporter(), InMemorySpanExporter()
    worker_tracing.provider.add_span_processor(SimpleSpanProcessor(worker_spans))
    owner_tracing.provider.add_span_processor(SimpleSpanProcessor(owner_spans))
    try:
        pair = await connect(stack.director)
        pair.owner._tracing = owner_tracing
        pair.remote.tracing = worker_tracing
        trace = worker_tracing.start({})
        trace.parse_started()
        parsed = request()
        trace.parsed(parsed)
        routed = await pair.remote.route(parsed, None, trace)
        trace.routed()
        routed.response_headers({":status": "200"})
        routed.finish("complete")
        trace.end("complete", routed)  # type: ignore[arg-type]
        worker = {span.name: span for span in worker_spans.get_finished_spans()}
        owner = {span.name: span for span in owner_spans.get_finished_spans()}
        assert set(worker) == {"gateway.request", "epp.parse", "gateway.request_orchestration", "epp.response"}
        assert set(owner) == {"epp.admission", "epp.scheduling"}
        orchestration = worker["gateway.request_orchestration"].context
        for span in owner.values():
            assert span.context.trace_id == orchestration.trace_id
            assert span.parent is not None and span.parent.span_id == orchestration.span_id
        assert owner["epp.scheduling"].attributes["epp.scheduling.endpoint"] == routed.primary.name
        assert worker["gateway.request_orchestration"].attributes["request_prio"] == 0
    finally:
        worker_tracing.shutdown()
        owner_tracing.shutdown()


async def test_a_message_that_does_not_encode_is_dropped_alone_not_with_its_frame(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame carries every message of a loop turn: one the channel cannot encode (a programming
    error, as a bench's stand-in once made) is logged and dropped; the route answered in the same
    frame still arrives (it waited forever: the whole frame was lost)."""
    pair = await connect(stack.director)
    send = pair.owner.send

    def with_a_bad_one(message: Any) -> None:
        if isinstance(message, ipc.Routed):
            send(ipc.Failed(0, object()))  # type: ignore[arg-type]  # queued in the same turn: one frame
        send(message)

    pair.owner.send = with_a_bad_one
    routed = await asyncio.wait_for(pair.remote.route(request()), 5)
    assert isinstance(routed, RemoteRouted)
    assert "dropped a Failed to the other process that does not encode" in caplog.text
