"""What the ``?name[]=`` filter saves on a vLLM-like pod, before and after asking it at ``/metrics/``.

vLLM 0.32 ignores ``?name[]=`` on ``/metrics`` (an instrumentator serves it) and honours it on
``/metrics/`` (prometheus_client's app); the simulator does the same (issue 13). For each way of asking,
the real scrape loops (:class:`epp.datalayer.loops.ScrapeLoops`, vLLM mapping, 50 ms interval) scrape
simulated pods for a few seconds; then the path each loop settled on is fetched again and its page
bytes measured (medians of 50 fetches per pod).

* ``before``: the previous request, ``/metrics?name[]=...`` (what the picker asked until now): the
  simulator, like vLLM, answers the whole page. The previous loop kept sending the query and got the
  whole page every scrape; the new one notices on the first page (``filter_ignored``: once per pod),
  then asks ``/metrics`` without it - the same whole page, which is what a pod that ignores the filter
  everywhere costs;
* ``after``: the default now, ``/metrics/?name[]=...``: filtered pages.

The CPU the simulator spends is not measured: its filter is Python, unlike vLLM's; issue 13 quotes a
real vLLM API server at about 97 ms of CPU a second for whole pages and 21 ms for filtered ones.

Run: ``python bench/metrics_filter.py [--seconds 3] [--pods 2]``. Talks only to 127.0.0.1; bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import statistics

import aiohttp

from epp.datalayer.engines import builtin_engines
from epp.datalayer.loops import ScrapeLoops, ScrapeResult, ScrapeSettings, Target, _filtered_path
from epp.sim import EngineConfig, SimulatedPool


async def _mode(pool: SimulatedPool, mode: str, seconds: float) -> dict[str, float | str]:
    engines = builtin_engines()
    vllm = engines["vllm"]
    if mode == "before":  # the old request: the query on /metrics itself
        engines["vllm"] = dataclasses.replace(vllm, filter_path=None)
    results: list[ScrapeResult] = []
    loops = ScrapeLoops(engines, ScrapeSettings(), results.append)
    for i, port in enumerate(pool.ports):
        loops.add(Target(f"pod-{i}", "127.0.0.1", port, "vllm"))
    await asyncio.sleep(seconds)
    paths = [loop.path for loop in loops.endpoints.values()]
    await loops.stop()
    ignored = sum(r.filter_ignored for r in results)
    sizes: list[int] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            for port, path in zip(pool.ports, paths, strict=True):
                async with session.get(f"http://127.0.0.1:{port}{path}") as response:
                    sizes.append(len(await response.read()))
    asked = _filtered_path("/metrics", engines["vllm"])
    return {
        "mode": mode,
        "first_asked": asked.split("?")[0] + ("?name[]=..." if "?" in asked else ""),
        "settled_on": paths[0].split("?")[0] + ("?name[]=..." if "?" in paths[0] else ""),
        "scrapes": len(results),
        "filter_ignored": ignored,
        "page_bytes": statistics.median(sizes),
    }


async def _main(seconds: float, pods: int) -> None:
    config = EngineConfig(time_scale=0.05, num_gpu_blocks=4096, max_model_len=8192)
    async with SimulatedPool(pods, config) as pool:
        rows = [await _mode(pool, mode, seconds) for mode in ("before", "after")]
    print(f"{'mode':8} {'first asked':22} {'settled on':22} {'scrapes':>7} {'ignored':>7} {'page B':>8}")
    for r in rows:
        print(f"{r['mode']:8} {r['first_asked']:22} {r['settled_on']:22} {r['scrapes']:>7} {r['filter_ignored']:>7} "
              f"{r['page_bytes']:>8.0f}")
    before, after = rows[0], rows[1]
    print(f"page bytes per scrape, before / after: {before['page_bytes']:.0f} / {after['page_bytes']:.0f} "
          f"= {float(before['page_bytes']) / float(after['page_bytes']):.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="scraping time per mode")
    parser.add_argument("--pods", type=int, default=2, help="simulated pods")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    asyncio.run(_main(args.seconds, args.pods))
