"""Start-up of the service (epp.server.server): port clashes fail at once, naming the flag (issue 15, item 6)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
from grpc_health.v1 import health_pb2

from epp.testing.envoy import free_ports
from epp.testing.harness import PickerProcess


@pytest.fixture(scope="module")
def first() -> Iterator[PickerProcess]:
    picker = PickerProcess(["127.0.0.1:1"], extra_args=["--scrape-metrics=false"])  # nothing answers there
    picker.start()
    yield picker
    picker.stop()


@pytest.mark.parametrize(
    ("flag", "attribute"),
    [("--grpc-port", "grpc_port"), ("--grpc-health-port", "health_port"), ("--metrics-port", "metrics_port")],
)
def test_a_second_picker_on_a_taken_port_stops_naming_the_flag(first: PickerProcess, flag: str, attribute: str) -> None:
    # gRPC sets SO_REUSEPORT by default: without turning it off, a second picker on the same
    # --grpc-port started without an error and took half of Envoy's streams.
    ports = dict(zip(("--grpc-port", "--grpc-health-port", "--metrics-port"), free_ports(3), strict=True))
    taken = getattr(first, attribute)
    ports[flag] = taken
    args = [f"{name}={port}" for name, port in ports.items()]
    second = subprocess.run(
        [sys.executable, "-m", "epp", "serve", "--bind-address", "127.0.0.1", "--secure-serving=false",
         "--endpoints", "127.0.0.1:1", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert second.returncode == 1
    assert f"cannot start: {flag} {taken}: cannot listen on 127.0.0.1:{taken}" in second.stderr
    assert "Traceback" not in second.stderr
    assert first.process is not None and first.process.poll() is None  # the first one is untouched


def test_the_harness_moves_a_listener_whose_port_was_taken_before_the_picker_bound_it() -> None:
    """free_port() then the bind is a race another process can win (a bench lost a 6-minute run so): the
    health and metrics ports are the harness's own to change; the gRPC port, which Envoy was given, is not."""
    picker = PickerProcess(["127.0.0.1:1"], extra_args=["--scrape-metrics=false"])
    taken = picker.health_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        picker.start()
        try:
            assert picker.health_port != taken
            assert picker.health() == health_pb2.HealthCheckResponse.SERVING
        finally:
            picker.stop()
    picker = PickerProcess(["127.0.0.1:1"], extra_args=["--scrape-metrics=false"])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", picker.grpc_port))
        squatter.listen()
        with pytest.raises(RuntimeError, match="--grpc-port"):
            picker.start()
    picker.stop()
