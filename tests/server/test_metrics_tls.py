"""--metrics-cert-dir and --metrics-client-ca-file: the metrics port over HTTPS, and mTLS (upstream's flags)."""

from __future__ import annotations

import http.client
import socket
import ssl
from pathlib import Path

import pytest

from epp.datalayer.static import parse_endpoints
from epp.server.cli import settings_from_args
from epp.server.flags import FlagError
from epp.server.server import EndpointPicker
from epp.server.tls import self_signed_certificate
from tests.pickers import loopback_settings


def _pair(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = self_signed_certificate(name)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert)
    (directory / "tls.key").write_bytes(key)
    return directory / "tls.crt", directory / "tls.key"


def _get(port: int, *, client: tuple[Path, Path] | None = None, timeout: float = 10) -> tuple[int, bytes]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    if client is not None:
        context.load_cert_chain(*client)
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=timeout)
    try:
        connection.request("GET", "/metrics")
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def _picker(tmp_path: Path, client_ca: str = "") -> EndpointPicker:
    _pair(tmp_path / "metrics", "epp-metrics")
    return EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints("127.0.0.1:9")),
            scrape_metrics=False,
            metrics_port=0,
            metrics_cert_dir=str(tmp_path / "metrics"),
            metrics_client_ca_file=client_ca,
        )
    )


async def test_the_metrics_port_serves_https_and_a_plaintext_client_costs_only_its_connection(tmp_path: Path) -> None:
    picker = _picker(tmp_path)
    await picker.start()
    try:
        status, body = _get(picker.metrics_port)
        assert status == 200 and b"inference_pool_ready_pods" in body
        plain = http.client.HTTPConnection("127.0.0.1", picker.metrics_port, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError, TimeoutError)):
            plain.request("GET", "/metrics")
            plain.getresponse()
        plain.close()
        assert _get(picker.metrics_port)[0] == 200  # still serving
        # A client that connects and never starts its handshake holds no one else up (the handshake
        # runs in its own request thread, not in the one that accepts).
        with socket.create_connection(("127.0.0.1", picker.metrics_port)):
            assert _get(picker.metrics_port, timeout=3)[0] == 200  # (the handshake timeout is 10 s)
    finally:
        await picker.stop(0)


async def test_a_client_ca_requires_a_certificate_it_signed(tmp_path: Path) -> None:
    client = _pair(tmp_path / "client", "prometheus")
    stranger = _pair(tmp_path / "stranger", "someone")
    picker = _picker(tmp_path, client_ca=str(client[0]))  # (the client's self-signed certificate is its own CA)
    await picker.start()
    try:
        assert _get(picker.metrics_port, client=client)[0] == 200
        for who in (None, stranger):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _get(picker.metrics_port, client=who)
    finally:
        await picker.stop(0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metrics-client-ca-file=/ca.pem"], '"metrics-client-ca-file" requires "metrics-cert-dir"'),
        (["--metrics-cert-dir=DIR", "--metrics-endpoint-auth=false"],
         '"metrics-cert-dir" enables metrics TLS without authentication; set "metrics-client-ca-file" or "metrics-endpoint-auth"'),
        (["--metrics-cert-dir=DIR"], "metrics TLS cert file unreadable: DIR/tls.crt: no such file"),
    ],
)  # fmt: skip
def test_the_flags_are_checked_as_upstream_checks_them(tmp_path: Path, argv: list[str], message: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FlagError) as info:
        settings_from_args([arg.replace("DIR", str(empty)) for arg in argv])
    assert str(info.value) == message.replace("DIR", str(empty))


def test_the_flags_reach_the_settings(tmp_path: Path) -> None:
    _pair(tmp_path, "m")
    settings, not_yet = settings_from_args(
        [f"--metrics-cert-dir={tmp_path}", f"--metrics-client-ca-file={tmp_path / 'tls.crt'}"]
    )
    assert (settings.metrics_cert_dir, settings.metrics_client_ca_file) == (str(tmp_path), str(tmp_path / "tls.crt"))
    assert not not_yet
