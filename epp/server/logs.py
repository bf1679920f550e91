"""Logging of the picker process: console lines or JSON objects (``--zap-encoder``) on stderr; epp's own
debug from ``-v 3``, a decision record per request from ``-v 4``, the libraries' debug (hpack logs every
header block it decodes, ~20 lines a second on an idle picker Envoy health-checks) only from ``-v 5``,
upstream's trace level."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

__all__ = ["configure_logging"]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(verbosity: int, fmt: str) -> None:
    """Send every log line to stderr in ``fmt`` (console or json), at the levels the module docstring says."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 5 else logging.INFO)
    logging.getLogger("epp").setLevel(logging.DEBUG if verbosity >= 3 else logging.NOTSET)
    # One decision record per request from -v 4 (upstream's debug level; epp.scheduling.decisions).
    logging.getLogger("epp.decisions").setLevel(logging.INFO if verbosity >= 4 else logging.WARNING)
