"""Scheduling latency of the default profile at 8, 64 and 256 pods.

Measures what the picker does per request between "the body is parsed" and "the pick is known":
the director's route (the pool snapshot, the prefix producer hashing and matching the prompt, the
queue, KV-cache and prefix scorers, max-score-picker, in-flight accounting and the prefix index
update after the pick), on the default configuration (no config file), with every plugin timed by
the production metrics. Pods carry realistic, varied metrics and in-flight requests; the prefix
index is warm (every pod has seen prompts of the same families); prompts are chat-sized (a 2-6k
character system prompt from one of 32 families plus a question).

Prints P50/P99/mean in microseconds per pod count, and the per-plugin share of the time.

    python bench/scheduling_latency.py [--requests 3000] [--pods 8,64,256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint, Handle, InferenceRequest, Metrics, PluginMetrics
from epp.requestcontrol.director import Director
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.server.metrics import Metrics as PickerMetrics

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _pods(count: int, rng: random.Random) -> list[Endpoint]:
    now = time.monotonic()
    pods = []
    for i in range(count):
        metrics = Metrics(
            waiting_queue_size=rng.choice([0, 0, 0, 1, 2, 5, 12]),
            running_requests=rng.randint(0, 64),
            kv_cache_usage=rng.random() * 0.9,
            num_gpu_blocks=16384,
            block_size=16,
            updated_at=now,
            stale=False,
        )
        pods.append(Endpoint(f"pod-{i}", f"10.1.{i // 250}.{i % 250 + 1}", 8000, metrics=metrics))
    return pods


def _prompts(rng: random.Random, n: int) -> list[str]:
    families = [f"family {f}: " + " ".join(f"w{rng.randint(0, 9999)}" for _ in range(rng.randint(400, 1200))) for f in range(32)]
    return [rng.choice(families)[: rng.randint(2000, 6000)] + f" question {i}?" for i in range(n)]


def _request(i: int, prompt: str) -> InferenceRequest:
    return InferenceRequest(request_id=str(i), method="POST", path="/v1/chat/completions", headers={}, model=MODEL, prompt=prompt)


def _measure(pod_count: int, requests: int, seed: int) -> tuple[list[float], dict[str, float]]:
    rng = random.Random(seed)
    datastore = Datastore(_pods(pod_count, rng))
    metrics = PickerMetrics()
    config = load_config(
        None, default_registry(), Handle(datastore, metrics=PluginMetrics(metrics.registry)), metrics=metrics.plugins
    )
    director = Director(datastore, config.scheduler, metrics.requests)
    prompts = _prompts(rng, requests * 2)
    loop = asyncio.new_event_loop()
    outstanding = []
    # Warm: the prefix index sees every family on several pods; requests stay in flight for a while.
    for i in range(requests):
        routing = loop.run_until_complete(director.route(_request(i, prompts[i])))
        outstanding.append(routing)
        if len(outstanding) > 4 * pod_count:
            outstanding.pop(0).finish()
    before = _plugin_sums(metrics)
    samples = []
    for i in range(requests, 2 * requests):
        request = _request(i, prompts[i])
        started = time.perf_counter()
        routing = loop.run_until_complete(director.route(request))
        samples.append(time.perf_counter() - started)
        outstanding.append(routing)
        if len(outstanding) > 4 * pod_count:
            outstanding.pop(0).finish()
    for routing in outstanding:
        routing.finish()
    loop.close()
    after = _plugin_sums(metrics)
    return samples, {key: (after[key] - before.get(key, 0.0)) / requests for key in after}


def _plugin_sums(metrics: PickerMetrics) -> dict[str, float]:
    """Seconds spent so far per (extension point, plugin name), from the production histogram."""
    sums = {}
    for family in metrics.registry.collect():
        if family.name == "inference_extension_plugin_duration_seconds":
            for sample in family.samples:
                if sample.name.endswith("_sum"):
                    sums[f"{sample.labels['extension_point']}:{sample.labels['plugin_name']}"] = sample.value
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--pods", default="8,64,256")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print("default profile (queue 2, kv 2, prefix 3, max-score-picker); per request: director.route incl. hooks")
    print(f"{'pods':>5} {'P50 µs':>8} {'P99 µs':>8} {'mean µs':>8}   per-plugin mean µs")
    for count in (int(p) for p in args.pods.split(",")):
        samples, shares = _measure(count, args.requests, args.seed)
        samples.sort()
        p50 = samples[len(samples) // 2] * 1e6
        p99 = samples[int(len(samples) * 0.99)] * 1e6
        parts = ", ".join(f"{k} {v * 1e6:.1f}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        print(f"{count:>5} {p50:8.1f} {p99:8.1f} {statistics.fmean(samples) * 1e6:8.1f}   {parts}")


if __name__ == "__main__":
    main()
