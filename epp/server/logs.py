"""Logging of the picker process: console lines or JSON objects (``--zap-encoder``) on stderr; epp's own
debug from ``-v 3``, a decision record per request from ``-v 4``, the libraries' debug (hpack logs every
header block it decodes, ~20 lines a second on an idle picker Envoy health-checks) only from ``-v 5``,
upstream's trace level. Upstream's ``--zap-log-level``, when given, wins over ``-v`` as it does upstream
(:func:`zap_level`): a number N is ``-v N``, ``info`` ``-v 0``, ``debug`` ``-v 1`` (zap's debug is
``V(1)``), and ``warn``, ``error``, ``dpanic``/``panic``/``fatal`` log only at that level and above.

controller-runtime's other zap flags, as upstream binds them: ``--zap-time-encoding`` (``epoch``,
``millis``, ``nano``, ``iso8601``, ``rfc3339``, ``rfc3339nano``: the JSON ``ts`` field and the console
line's first column, as zap writes them), ``--zap-stacktrace-level`` (records at that level and above
carry the stack of the logging call: a ``stacktrace`` field in JSON, lines after the message on the
console) and ``--zap-devel`` (given: zap's development defaults, console and stack traces from warn,
or with ``=false`` its production ones, JSON and stack traces from error, for what the other flags
do not set; zap's level stays -v's, as upstream derives it). With none of them: console lines with
the local time (``2026-12-04 15:44:04,123``), JSON with ``ts`` in seconds, no stack traces."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from collections.abc import Callable
from datetime import datetime
from typing import Any

__all__ = ["TIME_ENCODINGS", "configure_logging", "stack_level", "zap_level"]

TIME_ENCODINGS = ("epoch", "millis", "nano", "iso8601", "rfc3339", "rfc3339nano")
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING, "error": logging.ERROR,
           "dpanic": logging.CRITICAL, "panic": logging.CRITICAL, "fatal": logging.CRITICAL}  # fmt: skip


def _zone(moment: datetime, colon: bool) -> str:
    offset = moment.utcoffset()
    if not offset:
        return "Z"
    minutes = int(offset.total_seconds()) // 60
    sign, minutes = ("-", -minutes) if minutes < 0 else ("+", minutes)
    return f"{sign}{minutes // 60:02d}{':' if colon else ''}{minutes % 60:02d}"


def _time_encoder(name: str) -> Callable[[float], float | int | str]:
    """A record's time (``created``) as zap's encoder ``name`` writes it (Go's layouts, local time)."""
    if name == "epoch":
        return lambda created: created
    if name == "millis":
        return lambda created: created * 1000
    if name == "nano":
        return lambda created: int(created * 1e9)

    def text(created: float) -> str:
        moment = datetime.fromtimestamp(created).astimezone()
        base = moment.strftime("%Y-%m-%dT%H:%M:%S")
        if name == "iso8601":  # 2006-01-02T15:04:05.000Z0700
            return f"{base}.{moment.microsecond // 1000:03d}{_zone(moment, colon=False)}"
        if name == "rfc3339nano":  # 2006-01-02T15:04:05.999999999Z07:00: trailing zeros dropped
            fraction = f"{moment.microsecond:06d}".rstrip("0")
            return f"{base}{'.' + fraction if fraction else ''}{_zone(moment, colon=True)}"
        return f"{base}{_zone(moment, colon=True)}"  # rfc3339

    return text


def stack_level(text: str) -> int:
    """``--zap-stacktrace-level`` (a zap level name) as the logging level from which records carry a stack."""
    level = _LEVELS.get(text.strip().lower())
    if level is None:
        raise ValueError(
            f"invalid argument {text!r} for --zap-stacktrace-level: must be debug, info, warn, error, dpanic, "
            "panic or fatal"
        )
    return level


class _Stacks(logging.Filter):
    """Gives records at ``level`` and above the stack of the logging call (zap's AddStacktrace)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level and not record.stack_info:
            frame = sys._getframe(1)
            while frame.f_back is not None and frame.f_code.co_filename == logging.__file__:
                frame = frame.f_back  # (out of logging's own calls, to the caller's line)
            record.stack_info = "".join(traceback.format_stack(frame)).rstrip("\n")
        return True


class _ConsoleFormatter(logging.Formatter):
    def __init__(self, encode: Callable[[float], float | int | str] | None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._encode = encode

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return str(self._encode(record.created)) if self._encode is not None else super().formatTime(record, datefmt)

    def formatStack(self, stack_info: str) -> str:
        return stack_info


class _JsonFormatter(logging.Formatter):
    def __init__(self, encode: Callable[[float], float | int | str] | None) -> None:
        super().__init__()
        self._encode = encode

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._encode(record.created) if self._encode is not None else record.created,
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stacktrace"] = record.stack_info
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


def configure_logging(
    verbosity: int, fmt: str, floor: int = logging.NOTSET, *, time_encoding: str = "", stacks_from: int = 0
) -> None:
    """Send every log line to stderr in ``fmt`` (console or json), at the levels the module docstring says;
    nothing below ``floor``; times as zap's ``time_encoding`` writes them (empty: epp's own); the stack of
    the logging call on records from level ``stacks_from`` (0: none)."""
    handler = logging.StreamHandler(sys.stderr)
    encode = _time_encoder(time_encoding) if time_encoding else None
    handler.setFormatter(_JsonFormatter(encode) if fmt == "json" else _ConsoleFormatter(encode))
    if stacks_from:
        handler.addFilter(_Stacks(stacks_from))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbosity >= 5 else logging.INFO)
    logging.getLogger("epp").setLevel(logging.DEBUG if verbosity >= 3 else logging.NOTSET)
    # One decision record per request from -v 4 (upstream's debug level; epp.scheduling.decisions).
    logging.getLogger("epp.decisions").setLevel(logging.INFO if verbosity >= 4 else logging.WARNING)
    if floor > logging.INFO:
        for name in ("", "epp", "epp.decisions"):
            logging.getLogger(name).setLevel(floor)
