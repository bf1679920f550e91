"""Settings for an in-process picker in tests: every port chosen by the OS, on 127.0.0.1, plaintext."""

from __future__ import annotations

from typing import Any

from epp.server.settings import Settings

__all__ = ["loopback_settings"]

_LOOPBACK: dict[str, Any] = {
    "grpc_port": 0,
    "grpc_health_port": 0,
    "metrics_port": -1,  # no metrics server unless a test asks for one (metrics_port=0)
    "bind_address": "127.0.0.1",
    "secure_serving": False,
}


def loopback_settings(**fields: Any) -> Settings:
    """:class:`Settings` for a test's picker: the loopback defaults above, then ``fields``."""
    return Settings(**{**_LOOPBACK, **fields})
