"""Serving credentials for ``--secure-serving``: a certificate from ``--cert-path``, or a fresh
self-signed one (the upstream default: Envoy encrypts to the picker without verifying it)."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["self_signed_certificate", "server_credentials"]


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


def server_credentials(cert_path: str) -> grpc.ServerCredentials:
    """TLS credentials from ``cert_path``/tls.crt and tls.key, or self-signed when ``cert_path`` is empty."""
    if cert_path:
        directory = Path(cert_path)
        try:
            cert, key = (directory / "tls.crt").read_bytes(), (directory / "tls.key").read_bytes()
        except OSError as exc:
            raise ValueError(f"--cert-path {cert_path}: cannot read tls.crt and tls.key: {exc}") from exc
    else:
        cert, key = self_signed_certificate()
    return grpc.ssl_server_credentials([(key, cert)])
