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
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = [
    "RELOAD_INTERVAL",
    "CertificateReloader",
    "self_signed_certificate",
    "server_ssl_context",
    "ssl_context_from_pem",
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
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # HTTP/2 requires 1.2 or later (RFC 9113 section 9.2)
    if cert_path:
        directory = Path(cert_path)
        try:
            context.load_cert_chain(directory / "tls.crt", directory / "tls.key")
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--cert-path {cert_path}: cannot load tls.crt and tls.key: {exc}") from exc
        return context
    return ssl_context_from_pem(*self_signed_certificate())


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
        self._seen = self._signature()  # the pair the context was made from

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
