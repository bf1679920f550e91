"""bench/request_path_cpu.py drives the real request path: each request is routed and its stream ended."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "request_path_cpu.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("request_path_cpu", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_request_is_routed_answered_and_ended(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load_bench()
    processor = bench._processor(2)
    loop = bench.uvloop.new_event_loop()
    try:
        loop.run_until_complete(bench._serve(processor, bench._messages(1024), 20))  # (raises if one did not end)
    finally:
        loop.close()
    routed = processor._director.metrics.routed._value.get()
    assert routed == 20  # each request was routed (a refusal would have ended the stream too)
    assert bench.main(["--requests", "20", "--rounds", "1"]) == 0
    assert re.search(r"picker CPU per request, no wire: [\d.]+ µs", capsys.readouterr().out)
