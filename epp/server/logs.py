"""Logging of the picker process: console lines or JSON objects (``--zap-encoder``) on stderr; epp's own
debug from ``-v 3``, a decision record per request from ``-v 4``, the libraries' debug (hpack logs every
header block it decodes, ~20 lines a second on an idle picker Envoy health-checks) only from ``-v 5``,
upstream's trace level. Upstream's ``--zap-log-level``, when given, wins over ``-v`` as it does upstream
(:func:`zap_level`): a number N is ``-v N``, ``info`` ``-v 0``, ``debug`` ``-v 1`` (zap's debug is
``V(1)``), and ``warn``, ``error``, ``dpanic``/``panic``/``fatal`` log only at that level and above."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

__all__ = ["configure_logging", "zap_level"]


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


_ZAP_FLOORS = {"warn": logging.WARNING, "error": logging.ERROR, "dpanic": logging.CRITICAL,
               "panic": logging.CRITICAL, "fatal": logging.CRITICAL}  # fmt: skip


def zap_level(text: str) -> tuple[int, int]:
    """``--zap-log-level`` as (verbosity, the lowest level logged); ValueError for what zap refuses."""
    name = text.strip().lower()
    if name.isdigit() and int(name) > 0:
        return int(name), logging.NOTSET
    if name in ("info", "debug"):
        return (0 if name == "info" else 1), logging.NOTSET
    if name in _ZAP_FLOORS:
        return 0, _ZAP_FLOORS[name]
    raise ValueError(
        f"invalid argument {text!r} for --zap-log-level: must be debug, info, warn, error, dpanic, panic, fatal "
        "or an integer > 0"
    )


def configure_logging(verbosity: int, fmt: str, floor: int = logging.NOTSET) -> None:
    """Send every log line to stderr in ``fmt`` (console or json), at the levels the module docstring says;
    nothing below ``floor``."""
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
    if floor > logging.INFO:
        for name in ("", "epp", "epp.decisions"):
            logging.getLogger(name).setLevel(floor)
