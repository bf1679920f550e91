"""--tls-min-version and --tls-cipher-suites: upstream's Go names, checked at startup, set on what the picker serves."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from epp.datalayer.static import parse_endpoints
from epp.server.cli import settings_from_args
from epp.server.flags import FlagError
from epp.server.server import EndpointPicker
from epp.server.tls import TlsPolicy, apply_policy, self_signed_certificate, ssl_context_from_pem, tls_policy
from tests.pickers import loopback_settings


def test_go_names_become_openssl_terms() -> None:
    assert tls_policy("", []) == TlsPolicy(ssl.TLSVersion.TLSv1_2, ())
    assert tls_policy("VersionTLS13", []).minimum is ssl.TLSVersion.TLSv1_3
    assert tls_policy("VersionTLS10", []).minimum is ssl.TLSVersion.TLSv1_2  # (HTTP/2: 1.2 at least)
    policy = tls_policy(
        "VersionTLS12",
        [" TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "TLS_AES_128_GCM_SHA256", "", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"],
    )
    assert policy.ciphers == ("ECDHE-RSA-AES128-GCM-SHA256",)  # TLS 1.3's accepted, not configured; once each


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-min-version=TLS1.3"], "invalid tls-min-version 'TLS1.3': unknown TLS version; supported values: "
                                       "VersionTLS10, VersionTLS11, VersionTLS12, VersionTLS13"),
        (["--tls-cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,ECDHE-RSA-AES128-GCM-SHA256"],
         "invalid tls-cipher-suites: unknown cipher suite 'ECDHE-RSA-AES128-GCM-SHA256'"),
    ],
)  # fmt: skip
def test_an_unknown_name_stops_startup_naming_it(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as info:
        settings_from_args(argv)
    assert str(info.value) == message


def test_the_flags_reach_the_settings() -> None:
    settings, not_yet = settings_from_args(
        ["--tls-min-version", "VersionTLS13", "--tls-cipher-suites", "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,TLS_RSA_WITH_AES_128_CBC_SHA"]
    )
    assert settings.tls_min_version == "VersionTLS13"
    assert settings.tls_cipher_suites == ("TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384", "TLS_RSA_WITH_AES_128_CBC_SHA")
    assert not not_yet


def test_suites_this_openssl_does_not_offer() -> None:
    context = ssl_context_from_pem(*self_signed_certificate())
    apply_policy(context, tls_policy("", ["TLS_RSA_WITH_RC4_128_SHA", "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"]))
    assert {c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"} == {"ECDHE-ECDSA-AES128-GCM-SHA256"}
    with pytest.raises(ValueError, match="offers none of: RC4-SHA, DES-CBC3-SHA"):
        apply_policy(context, tls_policy("", ["TLS_RSA_WITH_RC4_128_SHA", "TLS_RSA_WITH_3DES_EDE_CBC_SHA"]))


async def _handshake(port: int, *, maximum: ssl.TLSVersion, ciphers: str | None = None) -> str:
    """The version a client that offers at most ``maximum`` (and only ``ciphers``) agrees on, or "refused"."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_alpn_protocols(["h2"])
    client.maximum_version = maximum
    if ciphers:
        client.set_ciphers(ciphers)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    except (ssl.SSLError, ConnectionError):  # (an alert, or the server's close before it: by implementation)
        return "refused"
    version = writer.get_extra_info("ssl_object").version()
    writer.close()
    return str(version)


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "workers"])
@pytest.mark.parametrize("native_tls", [True, False], ids=["native-tls", "uvloop-tls"])
async def test_a_running_picker_serves_what_the_flags_allow(workers: int, native_tls: bool) -> None:
    for argv, expected in (
        (["--tls-min-version=VersionTLS13"], {ssl.TLSVersion.TLSv1_2: "refused", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}),
        (["--tls-cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384"], {ssl.TLSVersion.TLSv1_2: "TLSv1.2"}),
    ):
        settings, _ = settings_from_args(argv)
        picker = EndpointPicker(
            loopback_settings(
                endpoints=tuple(parse_endpoints("127.0.0.1:9")),
                secure_serving=True,
                tls_min_version=settings.tls_min_version,
                tls_cipher_suites=settings.tls_cipher_suites,
                native_tls=native_tls,
                workers=workers,
                scrape_metrics=False,
            )
        )
        await picker.start()
        try:
            for maximum, outcome in expected.items():
                assert await _handshake(picker.grpc_port, maximum=maximum) == outcome, (argv, maximum)
            if settings.tls_cipher_suites:  # a TLS 1.2 client offering only another suite is refused
                refused = await _handshake(picker.grpc_port, maximum=ssl.TLSVersion.TLSv1_2, ciphers="ECDHE-ECDSA-AES128-GCM-SHA256")
                assert refused == "refused"
        finally:
            await picker.stop(0)
