"""What reading one pod's /metrics page costs: epp.datalayer.page against prometheus_client's parser.

The page is the vLLM simulator's (epp.sim.metrics, vLLM's names, help texts and bucket boundaries) after
some traffic: every histogram observed, HTTP metrics for two handlers, a LoRA history of 16 label
combinations; 55–58 KB, what a busy vLLM serves. A second page is the same without LoRA (vLLM
without --enable-lora), where the parser must search the whole page to learn that a metric is absent.

For each page it prints the median microseconds per parse over rounds (each round times a batch of
calls, so that timer overhead vanishes), the general parser's time (``text_string_to_metric_families``
consumed entirely, UTF-8 decoding included, as a scraper using it would), their ratio, and the share of
one core the targeted parser needs at the budget's rate (100 pods scraped 20 times a second).

Run: ``python bench/parse_metrics.py [--rounds N]``. Alone on the machine it takes a few seconds.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from epp.datalayer.engines import builtin_engines
from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.metrics import HttpStats, MetricsPage

_PARSES_PER_SECOND = 100 * 20  # the budget: 100 pods, one scrape every 50 ms each


def _page(lora: bool) -> bytes:
    rng = random.Random(0)
    adapters = tuple(f"adapter-{i}" for i in range(8)) if lora else ()
    engine = Engine(EngineConfig(lora_adapters=adapters, max_loras=4))
    for histogram in engine.stats.histograms:
        for _ in range(500):
            histogram.observe(rng.lognormvariate(0, 2))
    for i in range(20 if lora else 0):
        engine.lora_info.touch(",".join(rng.sample(adapters, 3)), ",".join(rng.sample(adapters, i % 3)))
    http = HttpStats()
    for handler in ("/v1/chat/completions", "/health"):
        for _ in range(50):
            http.record(handler, "POST", rng.choice((200, 200, 200, 400)), 2000, 800, rng.random())
    engine.version += 1
    return MetricsPage(engine, http).render()


def _general_parse(page: bytes) -> list[object]:
    """What a scraper using prometheus_client's parser would do: decode the page, consume every family."""
    return list(text_string_to_metric_families(page.decode()))


def _median_us(fn: Callable[[], object], rounds: int, batch: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter_ns() - start) / batch / 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=101, help="timed rounds per measurement (median taken)")
    args = parser.parse_args()
    vllm = builtin_engines()["vllm"]
    print(f"{'page':<22}{'bytes':>8}{'targeted µs':>14}{'general µs':>13}{'ratio':>9}{'core at 2000/s':>17}")
    for label, lora in (("vLLM with LoRA", True), ("vLLM without LoRA", False)):
        page = _page(lora)
        result = vllm.parse(page)
        assert not result.missing, result.missing  # the page has everything the vLLM mapping reads
        targeted = _median_us(functools.partial(vllm.parse, page), args.rounds, 500)
        general = _median_us(functools.partial(_general_parse, page), max(5, args.rounds // 10), 3)
        share = targeted * _PARSES_PER_SECOND / 1e6
        print(f"{label:<22}{len(page):>8}{targeted:>14.1f}{general:>13.0f}{general / targeted:>8.0f}x{share:>16.1%}")
    print(f"\nparsed: {result}")


if __name__ == "__main__":
    main()
