"""The static pool's flags, ``--endpoints`` and ``--endpoints-file``: read, checked, explained.

The parsing is :mod:`epp.datalayer.static`'s; this adds what an operator's mistakes need: a URL is
named as one (endpoints are ip:port: the picker answers Envoy with them), and labels joined by a
comma are refused, since Kubernetes label values never hold ``,`` or ``=`` and the file separates
labels with spaces (:data:`ENDPOINTS_FILE_HELP`, printed by ``epp serve -h``).
"""

from __future__ import annotations

from pathlib import Path

from epp.datalayer.static import check_unique, parse_endpoints, read_endpoints_file
from epp.framework import Endpoint
from epp.server.flags import FlagError

__all__ = ["ENDPOINTS_FILE_HELP", "static_endpoints"]

ENDPOINTS_FILE_HELP = """
--endpoints-file format: one endpoint per line, ip:port or [ipv6]:port, then optional pod labels
as space-separated key=value words; # starts a comment. For example:
  10.0.0.7:8000 inference.networking.k8s.io/engine-type=sglang zone=a
Labels are separated by spaces, not commas ("zone=a,tier=y" is refused). Two keys are ports, not
labels: kv-events=PORT and kv-replay=PORT, where that endpoint's server publishes its KV-cache events
(vLLM's --kv-events-config "endpoint": "tcp://*:PORT") and answers replays; the precise prefix-cache
producer follows them there:
  10.0.0.7:8000 kv-events=5557 kv-replay=5558"""


def _no_url(flag: str, text: str) -> None:
    """A FlagError for the first URL in ``text``: endpoints are ip:port (the picker answers with them)."""
    for word in text.replace(",", " ").split():
        if "://" in word:
            hostport = word.partition("://")[2].partition("/")[0]
            raise FlagError(
                f"{flag}: {word!r} is a URL, not an endpoint", f"give ip:port without scheme or path, e.g. {hostport}"
            )


def static_endpoints(flag_text: str, file: str) -> list[Endpoint]:
    """The static pool of --endpoints and --endpoints-file together, checked."""
    _no_url("--endpoints", flag_text)
    try:
        endpoints = parse_endpoints(flag_text)
    except ValueError as exc:
        raise FlagError(f"--endpoints: {exc}") from None
    if not file:
        return endpoints
    try:
        text = Path(file).read_text()
    except OSError as exc:
        raise FlagError(f"--endpoints-file: {exc}") from None
    _no_url("--endpoints-file", "\n".join(line.partition("#")[0] for line in text.splitlines()))
    try:
        endpoints = check_unique(endpoints + read_endpoints_file(file))
    except (OSError, ValueError) as exc:
        raise FlagError(f"--endpoints-file: {exc}") from None
    for endpoint in endpoints:
        for key, value in endpoint.labels.items():
            # Kubernetes label values never hold ',' or '=' (alphanumerics, '-', '_', '.'): such a
            # value is two labels written with a comma.
            if "," in value or "=" in value:
                raise FlagError(
                    f"--endpoints-file: {endpoint.hostport}: label {key}={value!r} is not one key=value label",
                    "separate labels with spaces: zone=a tier=y (see 'epp serve -h')",
                )
    return endpoints
