"""``--workers N`` (epp.server.workers): real worker processes behind an in-process owner; a worker that
dies, draining on stop, the flag, the health mirror and the debug view."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.datalayer.static import parse_endpoints
from epp.server.cli import main, settings_from_args
from epp.server.server import EXT_PROC_SERVICE, EndpointPicker
from epp_example_plugins import LocalityScorer
from tests.extproc.test_processor import COMPLETION, POST, Conversation, body, destination, headers
from tests.pickers import loopback_settings
from tests.plugins.test_example_plugin import CONFIG as EXAMPLE_CONFIG

POOL = "10.0.0.1:8000,10.0.0.2:8000"


async def start(**fields: object) -> EndpointPicker:
    settings = loopback_settings(
        endpoints=tuple(parse_endpoints(POOL)), scrape_metrics=False, workers=2, **fields
    )
    picker = EndpointPicker(settings)
    await picker.start()
    return picker


@pytest.fixture
async def picker() -> AsyncIterator[EndpointPicker]:
    running = await start(metrics_port=0, enable_debug_endpoints=True)
    yield running
    await running.stop(0)


def response_headers(status: str = "200", *, end_of_stream: bool = False) -> pb.ProcessingRequest:
    message = headers({":status": status}, end_of_stream=end_of_stream)
    return pb.ProcessingRequest(response_headers=message.request_headers)


def response_body(data: bytes, *, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


async def routed_stream(channel: grpc.aio.Channel) -> tuple[Conversation, str]:
    talk = Conversation(pb_grpc.ExternalProcessorStub(channel))
    await talk.send(headers(POST))
    await talk.send(body(COMPLETION, end_of_stream=True))
    picked = destination(await talk.read())
    await talk.read()  # the body, streamed back
    return talk, picked


async def complete(talk: Conversation) -> list[pb.ProcessingResponse]:
    await talk.send(response_headers())
    await talk.read()
    await talk.send(response_body(b'{"usage": {"prompt_tokens": 2, "completion_tokens": 3}}', end_of_stream=True))
    await talk.read()
    return await talk.finish()


def in_flight(picker: EndpointPicker) -> int:
    return sum(e.inflight.requests for e in picker.datastore.endpoints())


async def until(condition: object, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.02)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie not reaped yet is dead too


# -- serving -------------------------------------------------------------------------------------


async def test_workers_serve_ext_proc_and_the_owner_counts_each_request_once(picker: EndpointPicker) -> None:
    assert picker.workers is not None
    pids = picker.workers.pids()
    assert len(pids) == 2 and all(alive(pid) for pid in pids) and os.getpid() not in pids
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        for _ in range(3):
            talk, picked = await routed_stream(channel)
            assert picked in POOL.split(",")
            assert await complete(talk) == []
    await until(lambda: in_flight(picker) == 0, "the owner finished every request")
    value = picker.metrics.registry.get_sample_value
    assert value("epp_requests_total", {"outcome": "routed"}) == 3
    assert sum(value("epp_worker_requests_total", {"worker": str(i)}) or 0 for i in range(2)) == 3
    assert value("inference_objective_output_tokens_sum", {"model_name": "m", "target_model_name": "m"}) == 9
    with urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/debug/workers", timeout=5) as reply:
        view = json.load(reply)
    assert [w["pid"] for w in view["workers"]] == pids
    assert sum(w["requests"] for w in view["workers"]) == 3
    assert all(w["serving"] for w in view["workers"])


@pytest.mark.parametrize("service", ["", "readiness", "liveness", EXT_PROC_SERVICE])
async def test_the_ext_proc_port_answers_health_as_the_owner_sets_it(picker: EndpointPicker, service: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_workers_follow_the_owners_health_when_it_changes(picker: EndpointPicker) -> None:
    picker.health.set(EXT_PROC_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(100):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE))
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            await asyncio.sleep(0.02)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_connections_are_spread_over_the_workers(picker: EndpointPicker) -> None:
    assert picker.workers is not None
    # Each channel its own connection (gRPC shares one between channels to a target by default).
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}", options=options) for _ in range(4)]
    try:
        for channel in channels:
            talk, _ = await routed_stream(channel)
            await complete(talk)
        served = [w["connections"] for w in picker.workers.view()]
    finally:
        for channel in channels:
            await channel.close()
    assert sorted(served) == [2, 2]


# -- a worker that dies --------------------------------------------------------------------------


async def test_a_worker_that_dies_is_restarted_and_the_owner_finishes_what_it_held(picker: EndpointPicker) -> None:
    assert picker.workers is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        talk, _ = await routed_stream(channel)  # routed, its response not started: in flight in the owner
        assert in_flight(picker) == 1
        holder = next(w for w in picker.workers.view() if w["in_flight"] == 1)
        os.kill(holder["pid"], signal.SIGKILL)
        await until(lambda: in_flight(picker) == 0, "the owner finished the dead worker's request")
        with pytest.raises((grpc.RpcError, asyncio.InvalidStateError)):
            await complete(talk)  # its stream died with the worker
    value = picker.metrics.registry.get_sample_value
    assert value("inference_objective_running_requests", {"model_name": "m"}) == 0
    await until(
        lambda: all(w["serving"] for w in picker.workers.view()) and alive(picker.workers.pids()[holder["worker"]]),  # type: ignore[union-attr]
        "the worker was restarted",
    )
    restarted = picker.workers.view()[holder["worker"]]
    assert restarted["restarts"] == 1 and restarted["pid"] != holder["pid"]
    assert value("epp_worker_restarts_total", {"worker": str(holder["worker"])}) == 1
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        for _ in range(4):  # whichever worker takes them
            talk, _ = await routed_stream(channel)
            assert await complete(talk) == []


# -- stopping ------------------------------------------------------------------------------------


async def test_stop_drains_the_workers_open_streams_then_they_exit() -> None:
    picker = await start(shutdown_grace_seconds=10.0)
    assert picker.workers is not None
    pids = picker.workers.pids()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
        talk, _ = await routed_stream(channel)
        stopping = asyncio.ensure_future(picker.stop())
        await asyncio.sleep(0.3)
        assert not stopping.done()  # waiting for the open stream
        assert picker.health.get(EXT_PROC_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await complete(talk) == []  # the open stream finishes normally
        await asyncio.wait_for(stopping, 20)
    assert in_flight(picker) == 0
    assert not any(alive(pid) for pid in pids)


async def test_a_worker_that_cannot_start_stops_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.server.server import StartupError

    monkeypatch.setattr("sys.executable", "/bin/false")  # every worker exits at once
    picker = EndpointPicker(loopback_settings(endpoints=tuple(parse_endpoints(POOL)), scrape_metrics=False, workers=1))
    with pytest.raises(StartupError, match="--workers 1: the ext_proc workers did not start"):
        await picker.start()


# -- the flag ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "declared", "sends"),
    [(None, None, False), (EXAMPLE_CONFIG, False, False), (EXAMPLE_CONFIG, None, True)],
    ids=["epps-own", "third-party-saying-it-does-not", "third-party-silent"],
)
def test_the_workers_send_the_body_with_a_request_only_when_a_configured_plugin_may_read_it(
    config: str | None, declared: bool | None, sends: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The owner routes; a plugin that reads request.body (a tokenizer; a third party's that does not say)
    # needs it there. epp's own plugins say when they do (epp.framework.roles.reads_body).
    if declared is None:
        monkeypatch.delattr(LocalityScorer, "reads_body")  # (the example plugin says it reads none)
    settings = loopback_settings(endpoints=tuple(parse_endpoints(POOL)), scrape_metrics=False, workers=2,
                                 config_text=config)  # fmt: skip
    assert EndpointPicker(settings)._worker_spec(0).send_body is sends


def test_the_flag_defaults_to_one_process() -> None:
    settings, _ = settings_from_args(["--endpoints", "10.0.0.1:8000"])
    assert settings.workers == 0
    settings, _ = settings_from_args(["--endpoints", "10.0.0.1:8000", "--workers", "4"])
    assert settings.workers == 4


@pytest.mark.parametrize("value", ["-1", "257", "two"])
def test_a_bad_worker_count_is_a_usage_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--endpoints", "10.0.0.1:8000", f"--workers={value}"]) == 2
    assert "-workers" in capsys.readouterr().err


def test_the_help_names_the_flag_as_ours(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "-h"]) == 0
    out = capsys.readouterr().out
    assert "-workers int" in out and "not upstream's" in out


async def test_a_worker_that_carries_far_more_sheds_a_connection_to_the_other(monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.server import workers as module

    monkeypatch.setattr(module, "_BALANCE_INTERVAL", 0.3)
    monkeypatch.setattr(module, "_BALANCE_COOLDOWN", 60.0)
    picker = await start()
    assert picker.workers is not None
    options = [("grpc.use_local_subchannel_pool", 1)]
    busy = grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}", options=options)
    idle = grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}", options=options)
    try:
        for channel in (busy, idle):  # one connection each, one on each worker
            talk, _ = await routed_stream(channel)
            await complete(talk)
        start_counts = [w["requests"] for w in picker.workers.view()]
        deadline = asyncio.get_running_loop().time() + 30.0  # a bound, not a measurement
        while asyncio.get_running_loop().time() < deadline:  # all the traffic on one connection
            talk, _ = await routed_stream(busy)
            await complete(talk)
            counts = [w["requests"] - then for w, then in zip(picker.workers.view(), start_counts, strict=True)]
            if picker.workers.rebalances and min(counts) >= 5:
                break
    finally:
        await busy.close()
        await idle.close()
        await picker.stop(0)
    assert picker.workers.rebalances == 1  # then the cooldown
    assert min(counts) >= 5, counts  # the busy connection's requests moved to the other worker


def test_a_worker_claims_only_responses_a_sibling_of_the_same_owner_routed() -> None:
    from epp.requestcontrol import ipc
    from epp.requestcontrol.remote import RemoteDirector, RemoteRouted
    from epp.server.workers import _WorkerObserved

    posted: list[object] = []
    director = RemoteDirector(posted.append)
    observed = _WorkerObserved(director, "0123abcd0001")
    sibling = ipc.worker_token("0123abcd0002", 7)
    claimed = observed.claim(sibling)
    assert isinstance(claimed, RemoteRouted) and posted == [ipc.Claim(sibling, claimed.id)]
    for token in (
        ipc.worker_token("ffffffff0002", 7),  # another replica's (or an owner's before a restart)
        ipc.worker_token("0123abcd0001", 7),  # its own: it was here, and has ended
        "0123abcd0002" + "7",  # not a token of ours
    ):
        assert observed.claim(token) is None
    assert len(posted) == 1
