"""What ``--metrics-endpoint-auth`` adds to a scrape: one picker's /metrics, open and guarded, side by side.

A picker with discovery runs against the fake API server (epp.testing.fake_apiserver, on 127.0.0.1);
its metrics port is scraped over HTTP from a thread (as Prometheus would, a new connection each time),
in alternating rounds:

* ``open``: the same page with the guard off (what static mode and ``--metrics-endpoint-auth=false`` serve);
* ``cached``: a bearer token already decided (the cache: no API call);
* ``miss``: a new token each time (TokenReview + SubjectAccessReview through the event loop's client).

It prints the median milliseconds per scrape of each and their ratios to ``open``, and the number of
review calls the cached rounds made (0 expected). Run: ``python bench/metrics_auth.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from epp.server.server import EndpointPicker
from epp.server.settings import Settings
from epp.testing.fake_apiserver import FakeApiServer, make_pool

USER = "system:serviceaccount:monitoring:prometheus"


def _scrape(port: int, token: str | None) -> float:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()
        assert response.status == 200
    return time.perf_counter() - start


async def _picker(kubeconfig: Path, auth: bool) -> EndpointPicker:
    settings = Settings(
        pool_name="pool",
        kubeconfig=str(kubeconfig),
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        bind_address="127.0.0.1",
        secure_serving=False,
        scrape_metrics=False,
        metrics_endpoint_auth=auth,
    )
    picker = EndpointPicker(settings)
    await picker.start()
    return picker


async def main(rounds: int, per_round: int) -> None:
    async with FakeApiServer(token="bench") as api:
        api.apply(make_pool("pool", {"app": "vllm"}, [8000]))
        api.reviews.tokens["cached"] = USER
        api.reviews.allow(USER)
        with tempfile.TemporaryDirectory() as tmp:
            kubeconfig = api.kubeconfig(Path(tmp) / "kubeconfig")
            open_picker, guarded = await _picker(kubeconfig, False), await _picker(kubeconfig, True)
        try:
            await asyncio.to_thread(_scrape, guarded.metrics_port, "cached")  # decide it once
            times: dict[str, list[float]] = {"open": [], "cached": [], "miss": []}
            cached_calls = 0
            fresh = 0
            for _ in range(rounds):
                for _ in range(per_round):
                    times["open"].append(await asyncio.to_thread(_scrape, open_picker.metrics_port, None))
                    before = api.reviews.call_count()
                    times["cached"].append(await asyncio.to_thread(_scrape, guarded.metrics_port, "cached"))
                    cached_calls += api.reviews.call_count() - before
                    fresh += 1
                    api.reviews.tokens[f"t{fresh}"] = USER
                    times["miss"].append(await asyncio.to_thread(_scrape, guarded.metrics_port, f"t{fresh}"))
        finally:
            await open_picker.stop(grace=0)
            await guarded.stop(grace=0)
    base = statistics.median(times["open"])
    print(f"{'':8} {'median ms':>10} {'x open':>8}   ({rounds * per_round} scrapes each, alternating)")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:8} {median * 1e3:10.3f} {median / base:8.2f}")
    print(f"review calls made by the cached scrapes: {cached_calls}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=40)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.per_round))
