"""What the picker's scrapes cost a real vLLM 0.32 server: its CPU per second at 20 scrapes a second.

One real vLLM server (CPU, the real-vLLM tier's tiny model: ``EPP_VLLM_PYTHON`` and
``EPP_VLLM_MODELS`` from ``tests/realvllm/setup_tier.sh``) is started on 127.0.0.1. Then, in rounds
that alternate the modes side by side, the server's API process is asked for its metrics 20 times a
second (the picker's 50 ms default) for ``--seconds``, and its CPU time (user + system from /proc,
the API server process only: it serves the page) is divided by the window:

* ``idle``: no scrapes (the baseline the others are read against);
* ``whole``: ``GET /metrics?name[]=...`` — what the picker asked before issue 13: vLLM's
  instrumentator ignores the query and sends the whole page;
* ``filtered``: ``GET /metrics/?name[]=...`` — what the picker asks now (the vLLM mapping's
  ``filter_path``), which prometheus_client's own app filters.

Prints bytes per page and the median CPU ms per second of each mode, and each mode above idle.
Run: ``python bench/vllm_scrape_cost.py [--seconds 10] [--rounds 3]``. Talks only to 127.0.0.1;
bounded in time; stops the server by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from epp.datalayer.engines import builtin_engines
from epp.testing.harness import cpu_seconds
from epp.testing.vllm import start_vllm


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second (the picker's default: 20)")
    args = parser.parse_args()
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
        sizes = {mode: _fetch(url) for mode, url in urls.items() if url is not None}
        results: dict[str, list[float]] = {mode: [] for mode in urls}
        for _ in range(args.rounds):
            for mode, url in urls.items():
                results[mode].append(_window(process.pid, url, args.seconds, args.rate))
        medians = {mode: statistics.median(values) for mode, values in results.items()}
        print(f"vLLM API server CPU at {args.rate:g} scrapes/s ({args.rounds} rounds of {args.seconds:g} s, medians)")
        for mode in urls:
            size = f"{sizes[mode]:>7,} B/page" if mode in sizes else " " * 14
            above = f"  {medians[mode] - medians['idle']:6.1f} ms/s above idle" if mode != "idle" else ""
            rounds = " ".join(f"{v:.1f}" for v in results[mode])
            print(f"  {mode:<9} {size}  {medians[mode]:6.1f} ms/s{above}   rounds: {rounds}")
        print(json.dumps({"medians_ms_per_s": medians, "bytes": sizes}))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
