"""Serving TLS for ``--secure-serving``: a certificate from ``--cert-path``, or a fresh self-signed one
(the upstream default: Envoy encrypts to the picker without verifying it)."""

from __future__ import annotations

import datetime
import os
import socket
import ssl
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["self_signed_certificate", "server_ssl_context", "ssl_context_from_pem"]


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
    # load_cert_chain reads files only: the pair goes through a private file that is removed at once.
    with tempfile.TemporaryDirectory(prefix="epp-tls-") as private:
        pem = os.path.join(private, "tls.pem")
        with open(os.open(pem, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
            file.write(key + cert)
        context.load_cert_chain(pem)
    return context
