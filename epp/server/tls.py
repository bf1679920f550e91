"""Serving TLS for ``--secure-serving``: a certificate from ``--cert-path``, or a fresh self-signed one
(the upstream default: Envoy encrypts to the picker without verifying it).

``--enable-cert-reload`` (upstream's flag; off by default, as upstream): :class:`CertificateReloader`
looks at ``--cert-path``'s ``tls.crt`` and ``tls.key`` every :data:`RELOAD_INTERVAL` seconds (two
``stat`` calls; a Kubernetes Secret volume swaps its files by renaming a symlinked directory, which
changes what the names resolve to) and, when either changed, loads the new pair into the *same*
``ssl.SSLContext`` the server serves from: every handshake after that presents the new certificate,
with either TLS implementation (uvloop's and ``epp.wire._fast.TlsTransport`` both make each
connection's session from that context), and connections already open keep theirs until they end,
as with upstream's certificate watcher. The pair is first loaded into a fresh context of its own: a
certificate written before its key (or a key that does not match) is refused there, logged, and tried
again at the next change, while the server goes on with the pair it has. In ``--workers`` mode each
worker process watches for its own context.

``--tls-min-version`` and ``--tls-cipher-suites`` (upstream's, with Go's names): :func:`tls_policy`
checks them as upstream does (an unknown version or suite name stops startup, naming it) and
:func:`apply_policy` sets them on a serving context: the lowest version (``VersionTLS12`` or
``VersionTLS13``; HTTP/2 needs 1.2 at least, RFC 9113 section 9.2, so ``VersionTLS10`` and
``VersionTLS11`` serve 1.2 and up, as any h2 client negotiates anyway), and the TLS 1.2 suites, by
their OpenSSL names. TLS 1.3's suites are accepted and not configured, as in Go. Suites this OpenSSL
does not offer (RC4, 3DES) are named in a warning; if none is left, startup stops.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "RELOAD_INTERVAL",
    "CertificateReloader",
    "TlsPolicy",
    "apply_policy",
    "metrics_ssl_context",
    "self_signed_certificate",
    "server_ssl_context",
    "ssl_context_from_pem",
    "tls_policy",
]

log = logging.getLogger(__name__)

RELOAD_INTERVAL = 1.0
"""Seconds between two looks at --cert-path's files (a Secret's update reaches its pods in about a minute)."""


def self_signed_certificate(common_name: str = "epp") -> tuple[bytes, bytes]:
    """A new (certificate PEM, private key PEM), valid for ten years, for ``common_name`` and localhost."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    names: list[x509.GeneralName] = [
        x509.DNSName(common_name),
        x509.DNSName("localhost"),
        x509.DNSName(socket.gethostname()),
    ]
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def server_ssl_context(cert_path: str) -> ssl.SSLContext:
    """A TLS server context from ``cert_path``/tls.crt and tls.key, or self-signed when ``cert_path`` is empty."""
    if cert_path:
        return _context_from_dir(cert_path, "--cert-path")
    return ssl_context_from_pem(*self_signed_certificate())


def _context_from_dir(directory: str, flag: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context serving ``directory``'s tls.crt and tls.key; ValueError naming ``flag``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # HTTP/2 requires 1.2 or later (RFC 9113 section 9.2)
    try:
        context.load_cert_chain(Path(directory) / "tls.crt", Path(directory) / "tls.key")
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"{flag} {directory}: cannot load tls.crt and tls.key: {exc}") from exc
    return context


def metrics_ssl_context(cert_dir: str, client_ca: str = "") -> ssl.SSLContext:
    """HTTPS for the metrics port (``--metrics-cert-dir``: tls.crt and tls.key), requiring a client
    certificate ``client_ca`` signed when given (``--metrics-client-ca-file``), TLS 1.2 at least, as upstream."""
    context = _context_from_dir(cert_dir, "--metrics-cert-dir")
    if client_ca:
        try:
            context.load_verify_locations(client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"--metrics-client-ca-file {client_ca}: no CA certificate to verify clients with: {exc}"
            ) from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def ssl_context_from_pem(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A TLS server context serving the PEM certificate ``cert`` with its private key ``key``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # HTTP/2 requires 1.2 or later (RFC 9113 section 9.2)
    _load_pem(context, cert, key)
    return context


def _load_pem(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # load_cert_chain reads files only: the pair goes through a private file that is removed at once.
    with tempfile.TemporaryDirectory(prefix="epp-tls-") as private:
        pem = os.path.join(private, "tls.pem")
        with open(os.open(pem, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
            file.write(key + cert)
        context.load_cert_chain(pem)


class CertificateReloader:
    """``--enable-cert-reload``: ``context`` serves ``cert_path``'s pair anew when it changes (module docstring)."""

    def __init__(self, context: ssl.SSLContext, cert_path: str) -> None:
        self._context = context
        self._files = (Path(cert_path) / "tls.crt", Path(cert_path) / "tls.key")
        self.reloads = self.failures = 0
        # The pair the context was made from (a change between that load and this look, during startup,
        # is served at the files' next change).
        self._seen = self._signature()

    def _signature(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """What tells a file's new content from its old: device, inode, size, mtime (names followed)."""
        try:
            stats = [os.stat(file) for file in self._files]
        except OSError:
            return None  # (between a Secret's rename and its link, say: looked at again next time)
        return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)

    def check(self) -> bool:
        """Load the pair if it changed since it was last tried; True when the context serves a new one."""
        signature = self._signature()
        if signature is None or signature == self._seen:
            return False
        self._seen = signature  # a broken pair is tried once a change, not every look
        try:
            cert, key = (file.read_bytes() for file in self._files)
            ssl_context_from_pem(cert, key)  # the pair must make a context of its own first
            _load_pem(self._context, cert, key)
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.error("--cert-path %s changed, but the new tls.crt and tls.key cannot be served (%s); "
                      "serving the previous certificate", self._files[0].parent, exc)  # fmt: skip
            self.failures += 1
            return False
        log.info("--cert-path %s: serving the new certificate to new connections", self._files[0].parent)
        self.reloads += 1
        return True

    async def run(self, interval: float = RELOAD_INTERVAL) -> None:
        """Look every ``interval`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval)
            self.check()


# Go's crypto/tls version names (upstream's --tls-min-version values).
_GO_VERSIONS = {
    "VersionTLS10": ssl.TLSVersion.TLSv1_2,  # (HTTP/2: 1.2 at least; see the module docstring)
    "VersionTLS11": ssl.TLSVersion.TLSv1_2,
    "VersionTLS12": ssl.TLSVersion.TLSv1_2,
    "VersionTLS13": ssl.TLSVersion.TLSv1_3,
}

# Go's crypto/tls cipher suite names (CipherSuites() and InsecureCipherSuites()) -> OpenSSL's; None: a
# TLS 1.3 suite, which neither Go nor Python's ssl lets one choose.
_GO_SUITES: dict[str, str | None] = {
    "TLS_RSA_WITH_RC4_128_SHA": "RC4-SHA",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA": "DES-CBC3-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256": "AES128-SHA256",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA": "ECDHE-ECDSA-RC4-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA": "ECDHE-RSA-RC4-SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA": "ECDHE-RSA-DES-CBC3-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256": "ECDHE-ECDSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256": "ECDHE-RSA-AES128-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}


@dataclass(frozen=True)
class TlsPolicy:
    """What --tls-min-version and --tls-cipher-suites ask of a serving context (OpenSSL's terms)."""

    minimum: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    ciphers: tuple[str, ...] = ()  # OpenSSL names of the TLS 1.2 suites; empty: OpenSSL's defaults


def tls_policy(min_version: str, suites: Sequence[str]) -> TlsPolicy:
    """The policy of upstream's flags (Go's names); ValueError naming what is unknown, as upstream says it."""
    minimum = ssl.TLSVersion.TLSv1_2
    if min_version:
        if min_version not in _GO_VERSIONS:
            raise ValueError(
                f"invalid tls-min-version {min_version!r}: unknown TLS version; "
                f"supported values: {', '.join(_GO_VERSIONS)}"
            )
        minimum = _GO_VERSIONS[min_version]
    ciphers = []
    for name in (name.strip() for name in suites):
        if not name:
            continue
        if name not in _GO_SUITES:
            raise ValueError(f"invalid tls-cipher-suites: unknown cipher suite {name!r}")
        openssl = _GO_SUITES[name]
        if openssl is not None and openssl not in ciphers:
            ciphers.append(openssl)
    return TlsPolicy(minimum, tuple(ciphers))


def apply_policy(context: ssl.SSLContext, policy: TlsPolicy) -> None:
    """Set ``policy`` on a serving context; ValueError if none of its suites is offered by this OpenSSL."""
    context.minimum_version = policy.minimum
    if not policy.ciphers:
        return
    offered = []
    for name in policy.ciphers:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(name)
        except ssl.SSLError:
            continue
        offered.append(name)
    missing = [name for name in policy.ciphers if name not in offered]
    if not offered:
        version = ssl.OPENSSL_VERSION
        raise ValueError(f"--tls-cipher-suites: this OpenSSL ({version}) offers none of: {', '.join(missing)}")
    if missing:
        log.warning("--tls-cipher-suites: this OpenSSL (%s) does not offer %s; serving with the others",
                    ssl.OPENSSL_VERSION, ", ".join(missing))  # fmt: skip
    context.set_ciphers(":".join(offered))
