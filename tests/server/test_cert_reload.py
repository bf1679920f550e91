"""--enable-cert-reload: a running picker serves --cert-path's new pair to new connections (epp.server.tls)."""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

import pytest

from epp.datalayer.static import parse_endpoints
from epp.server.server import EndpointPicker
from epp.server.tls import CertificateReloader, self_signed_certificate, server_ssl_context
from tests.pickers import loopback_settings


def _secret(directory: Path, version: str, cert: bytes, key: bytes) -> None:
    """Write the pair as a Kubernetes Secret volume does: a new timestamped directory, then ``..data``
    renamed onto a link to it; ``tls.crt`` and ``tls.key`` are links through ``..data``."""
    target = directory / f"..{version}"
    target.mkdir()
    (target / "tls.crt").write_bytes(cert)
    (target / "tls.key").write_bytes(key)
    link = directory / "..data_tmp"
    link.symlink_to(target.name)
    os.replace(link, directory / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")


def _served(context: ssl.SSLContext) -> bytes:
    """The certificate (DER) a handshake with ``context`` presents, over memory BIOs."""
    client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_context.check_hostname = False
    client_context.verify_mode = ssl.CERT_NONE
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, to_server)
    server = context.wrap_bio(to_server, to_client, server_side=True)
    done = {client: False, server: False}
    for _ in range(10):
        for side in (client, server):
            try:
                side.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
        if all(done.values()):
            break
    peer = client.getpeercert(binary_form=True)
    assert peer is not None
    return peer


def _der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


def test_a_changed_pair_is_served_and_a_broken_one_is_not(tmp_path: Path) -> None:
    first, second, third = self_signed_certificate("one"), self_signed_certificate("two"), self_signed_certificate("3")
    _secret(tmp_path, "v1", *first)
    context = server_ssl_context(str(tmp_path))
    reloader = CertificateReloader(context, str(tmp_path))
    assert _served(context) == _der(first[0])
    assert not reloader.check()  # nothing changed
    _secret(tmp_path, "v2", *second)
    assert reloader.check() and reloader.reloads == 1
    assert _served(context) == _der(second[0])
    # A certificate whose key has not come yet: refused, the context goes on with the pair it has.
    _secret(tmp_path, "v3", third[0], second[1])
    assert not reloader.check() and reloader.failures == 1
    assert _served(context) == _der(second[0])
    assert not reloader.check() and reloader.failures == 1  # tried once a change, not at every look
    _secret(tmp_path, "v4", *third)  # the key arrives
    assert reloader.check() and reloader.reloads == 2
    assert _served(context) == _der(third[0])


def test_files_that_are_gone_for_a_moment_are_looked_at_again(tmp_path: Path) -> None:
    first, second = self_signed_certificate("one"), self_signed_certificate("two")
    (tmp_path / "tls.crt").write_bytes(first[0])
    (tmp_path / "tls.key").write_bytes(first[1])
    context = server_ssl_context(str(tmp_path))
    reloader = CertificateReloader(context, str(tmp_path))
    (tmp_path / "tls.key").unlink()
    assert not reloader.check() and reloader.failures == 0
    (tmp_path / "tls.crt").write_bytes(second[0])
    (tmp_path / "tls.key").write_bytes(second[1])
    assert reloader.check()
    assert _served(context) == _der(second[0])


async def _certificate_of(port: int) -> bytes:
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_alpn_protocols(["h2"])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        peer = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert peer is not None
        return bytes(peer)
    finally:
        writer.close()


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "workers"])
@pytest.mark.parametrize("native_tls", [True, False], ids=["native-tls", "uvloop-tls"])
async def test_a_running_picker_serves_the_new_certificate_to_new_connections(
    tmp_path: Path, workers: int, native_tls: bool
) -> None:
    first, second = self_signed_certificate("one"), self_signed_certificate("two")
    _secret(tmp_path, "v1", *first)
    picker = EndpointPicker(
        loopback_settings(
            endpoints=tuple(parse_endpoints("127.0.0.1:9")),
            secure_serving=True,
            cert_path=str(tmp_path),
            cert_reload=True,
            native_tls=native_tls,
            workers=workers,
            scrape_metrics=False,
        )
    )
    await picker.start()
    try:
        assert await _certificate_of(picker.grpc_port) == _der(first[0])
        _secret(tmp_path, "v2", *second)
        for _ in range(100):  # every worker (or the one process) looks about once a second
            seen = {await _certificate_of(picker.grpc_port) for _ in range(4)}
            if seen == {_der(second[0])}:
                break
            await asyncio.sleep(0.1)
        assert seen == {_der(second[0])}
    finally:
        await picker.stop(0)
