"""epp.server.logs: controller-runtime's zap flags as this picker honours them (time encodings, stack
traces, development and production defaults)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import pytest

from epp.server.cli import FlagError, settings_from_args
from epp.server.logs import configure_logging

MOMENT = 1_764_862_044.123456  # 2025-12-04T15:27:24.123456Z


class Stderr:
    """What the picker's log handler wrote (to stderr, which pytest captures while the test runs)."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys

    def getvalue(self) -> str:
        return self._capsys.readouterr().err


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[Stderr]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in ("epp", "epp.decisions")}
    yield Stderr(capsys)
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, kept in levels.items():
        logging.getLogger(name).setLevel(kept)


@pytest.fixture
def zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The local time zone is India's (+05:30): offsets that are not whole hours, and not Z."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _record_at(message: str, level: int = logging.WARNING) -> None:
    record = logging.getLogger("epp.test").makeRecord("epp.test", level, __file__, 1, message, (), None)
    record.created = MOMENT
    logging.getLogger("epp.test").handle(record)


@pytest.mark.parametrize(
    ("encoding", "ts"),
    [
        ("epoch", MOMENT),
        ("millis", MOMENT * 1000),
        ("nano", int(MOMENT * 1e9)),
        ("iso8601", "2025-12-04T20:57:24.123+0530"),
        ("rfc3339", "2025-12-04T20:57:24+05:30"),
        ("rfc3339nano", "2025-12-04T20:57:24.123456+05:30"),
    ],
)
def test_each_time_encoding_writes_the_json_ts_as_zap_does(
    stderr: Stderr, zone: None, encoding: str, ts: float | int | str
) -> None:
    configure_logging(1, "json", time_encoding=encoding)
    _record_at("hello")
    entry = json.loads(stderr.getvalue())
    assert entry["ts"] == pytest.approx(ts) if isinstance(ts, float) else entry["ts"] == ts
    assert entry["msg"] == "hello"


def test_utc_is_written_z_and_a_whole_second_without_a_fraction(stderr: Stderr, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        configure_logging(1, "console", time_encoding="rfc3339nano")
        record = logging.getLogger("epp.test").makeRecord("epp.test", logging.WARNING, __file__, 1, "m", (), None)
        record.created = 1_764_862_044.0
        logging.getLogger("epp.test").handle(record)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert stderr.getvalue().startswith("2025-12-04T15:27:24Z WARNING epp.test: m")


def _log_from_here(level: int) -> None:
    logging.getLogger("epp.test").log(level, "with a stack?")


def test_records_from_the_stacktrace_level_carry_the_logging_call_s_stack(stderr: Stderr) -> None:
    configure_logging(1, "json", stacks_from=logging.ERROR)
    _log_from_here(logging.WARNING)
    _log_from_here(logging.ERROR)
    warning, error = (json.loads(line) for line in stderr.getvalue().splitlines())
    assert "stacktrace" not in warning
    assert "_log_from_here" in error["stacktrace"]  # the caller's frame, logging's own left out
    assert "logging/__init__.py" not in error["stacktrace"].splitlines()[-2]


def test_on_the_console_the_stack_follows_the_message(stderr: Stderr) -> None:
    configure_logging(1, "console", stacks_from=logging.WARNING)
    _log_from_here(logging.WARNING)
    first, *rest = stderr.getvalue().splitlines()
    assert first.endswith("WARNING epp.test: with a stack?")
    assert any("_log_from_here" in line for line in rest)


def test_without_the_flags_lines_are_as_before(stderr: Stderr) -> None:
    configure_logging(1, "json")
    _log_from_here(logging.ERROR)
    entry = json.loads(stderr.getvalue())
    assert isinstance(entry["ts"], float) and "stacktrace" not in entry


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], ("console", 0, "")),
        (["--zap-devel"], ("console", logging.WARNING, "")),
        (["--zap-devel=false"], ("json", logging.ERROR, "")),
        (["--zap-devel=false", "--zap-encoder=console"], ("console", logging.ERROR, "")),
        (["--zap-devel", "--zap-stacktrace-level=panic"], ("console", logging.CRITICAL, "")),
        (["--zap-stacktrace-level=info", "--zap-time-encoding=RFC3339"], ("console", logging.INFO, "rfc3339")),
    ],
)
def test_zap_devel_gives_zap_s_defaults_under_what_the_other_flags_set(args: list[str], expected: tuple[str, int, str]) -> None:
    settings, _ = settings_from_args(["--endpoints", "127.0.0.1:8000", *args])
    assert (settings.log_format, settings.log_stacks_from, settings.log_time_encoding) == expected


@pytest.mark.parametrize("arg", ["--zap-time-encoding=unix", "--zap-stacktrace-level=loud"])
def test_a_value_zap_refuses_is_a_flag_error(arg: str) -> None:
    with pytest.raises(FlagError, match=arg.split("=")[0].lstrip("-")):
        settings_from_args(["--endpoints", "127.0.0.1:8000", arg])
