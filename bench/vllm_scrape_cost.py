"""What the picker's scrapes cost a real vLLM 0.32 server: its CPU per second, at 20 scrapes a second and with backoff.

One real vLLM server (CPU, the real-vLLM tier's tiny model: ``EPP_VLLM_PYTHON`` and
``EPP_VLLM_MODELS`` from ``tests/realvllm/setup_tier.sh``) is started on 127.0.0.1. Then, in rounds
that alternate the modes side by side, the server's API process is asked for its metrics 20 times a
second (the picker's 50 ms default) for ``--seconds``, and its CPU time (user + system from /proc,
the API server process only: it serves the page) is divided by the window:

* ``idle``: no scrapes (the baseline the others are read against);
* ``whole``: ``GET /metrics?name[]=...`` — what the picker asked before issue 13: vLLM's
  instrumentator ignores the query and sends the whole page;
* ``filtered``: ``GET /metrics/?name[]=...`` — what the picker asks now (the vLLM mapping's
  ``filter_path``), which prometheus_client's own app filters;
* ``picker-backoff`` and ``picker-no-backoff``: a real picker (``epp serve``) scraping the server
  with its defaults, and with ``--refresh-metrics-idle-interval=0`` (every 50 ms, as upstream); the
  server serves no traffic, so its numbers do not change and the backoff asks it ~once a second.
  The picker starts before the window and gets ``--settle`` seconds to back off; its own scrape
  count over the window is printed beside. (It also reads ``/v1/models``, at its start and every
  30 s: in both modes alike.)

Prints bytes per page and the median CPU ms per second of each mode, and each mode above idle.
Run: ``python bench/vllm_scrape_cost.py [--seconds 10] [--rounds 3] [--modes idle,filtered,...]``.
Talks only to 127.0.0.1; bounded in time; stops the server and the pickers by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from epp.datalayer.engines import builtin_engines
from epp.testing.harness import PickerProcess, cpu_seconds
from epp.testing.vllm import start_vllm

_FETCHED = ("idle", "whole", "filtered")  # the modes that fetch the page themselves (idle: not at all)
# The picker modes: its extra flags.
_PICKERS = {"picker-backoff": [], "picker-no-backoff": ["--refresh-metrics-idle-interval=0"]}


def _fetch(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return len(reply.read())


def _window(pid: int, url: str | None, seconds: float, rate: float) -> float:
    """CPU ms per second of ``pid`` while ``url`` is fetched ``rate`` times a second (None: idle)."""
    cpu0, start = cpu_seconds(pid, children=False), time.monotonic()
    n = 0
    while (now := time.monotonic()) - start < seconds:
        if url is not None:
            _fetch(url)
        n += 1
        time.sleep(max(0.0, start + n / rate - time.monotonic()))
    return (cpu_seconds(pid, children=False) - cpu0) * 1000 / (now - start)


def _picker_window(pid: int, hostport: str, flags: list[str], seconds: float, settle: float) -> tuple[float, float]:
    """CPU ms per second of ``pid`` while a picker scrapes ``hostport`` with ``flags``, and its scrapes per second."""
    picker = PickerProcess([hostport], extra_args=flags)
    picker.start()
    try:
        time.sleep(settle)
        scrapes0 = _scrapes(picker)
        cpu0, start = cpu_seconds(pid, children=False), time.monotonic()
        time.sleep(seconds)
        cpu1, end = cpu_seconds(pid, children=False), time.monotonic()
        scrapes1 = _scrapes(picker)
    finally:
        picker.stop()
    return (cpu1 - cpu0) * 1000 / (end - start), (scrapes1 - scrapes0) / (end - start)


def _scrapes(picker: PickerProcess) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{picker.metrics_port}/metrics", timeout=5).read().decode()
    match = re.search(r"^epp_endpoint_scrapes_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second (the picker's default: 20)")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds a picker runs before its window")
    parser.add_argument("--modes", default=",".join([*_FETCHED, *_PICKERS]), help="a comma-separated subset")
    args = parser.parse_args()
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if "idle" not in modes:
        modes.insert(0, "idle")  # what the others are read against
    if unknown := [mode for mode in modes if mode not in (*_FETCHED, *_PICKERS)]:
        parser.error(f"unknown modes {unknown}; choose from {', '.join([*_FETCHED, *_PICKERS])}")
    python, models = os.environ.get("EPP_VLLM_PYTHON"), os.environ.get("EPP_VLLM_MODELS")
    if not python or not models:
        print("needs EPP_VLLM_PYTHON and EPP_VLLM_MODELS (source tests/realvllm/setup_tier.sh)", file=sys.stderr)
        return 2
    vllm = builtin_engines()["vllm"]
    query = urllib.parse.urlencode([("name[]", name) for name in vllm.metric_names()])
    server = start_vllm(python, Path(models), "bench", lora=True, kv_events=False)
    process = server.process
    try:
        server.wait_healthy()
        base = server.url
        urls = {"idle": None, "whole": f"{base}/metrics?{query}", "filtered": f"{base}{vllm.filter_path}?{query}"}
        sizes = {mode: _fetch(url) for mode, url in urls.items() if url is not None and mode in modes}
        results: dict[str, list[float]] = {mode: [] for mode in modes}
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                if mode in _PICKERS:
                    hostport = f"127.0.0.1:{server.port}"
                    cpu, rate = _picker_window(process.pid, hostport, _PICKERS[mode], args.seconds, args.settle)
                else:
                    cpu, rate = _window(process.pid, urls[mode], args.seconds, args.rate), args.rate
                results[mode].append(cpu)
                rates[mode].append(0.0 if mode == "idle" else rate)
        medians = {mode: statistics.median(values) for mode, values in results.items()}
        print(f"vLLM API server CPU ({args.rounds} alternating rounds of {args.seconds:g} s, medians)")
        for mode in modes:
            size = f"{sizes[mode]:>7,} B/page" if mode in sizes else " " * 14
            above = f"  {medians[mode] - medians['idle']:6.1f} ms/s above idle" if mode != "idle" else " " * 22
            rounds = " ".join(f"{v:.1f}" for v in results[mode])
            scrapes = statistics.median(rates[mode])
            print(f"  {mode:<18} {size}  {scrapes:5.1f} scrapes/s  {medians[mode]:6.1f} ms/s{above}   rounds: {rounds}")
        print(json.dumps({"medians_ms_per_s": medians, "bytes": sizes}))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
