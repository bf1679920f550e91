"""Endpoints and requests for the plugin tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from epp.datalayer.inflight import InFlight
from epp.framework import Endpoint, InferenceRequest, Metrics

SCRAPED_AT = 100.0  # the time.monotonic() instant every test pod was last scraped


def pod(
    i: int,
    *,
    queue: int = 0,
    running: int = 0,
    kv: float = 0.0,
    stale: bool = False,
    running_adapters: Iterable[str] = (),
    waiting_adapters: Iterable[str] = (),
    max_adapters: int = 0,
    labels: Mapping[str, str] | None = None,
    cache_tokens: int | None = None,
) -> Endpoint:
    """``pod-i`` at 10.0.0.i:8000, scraped at :data:`SCRAPED_AT`. ``cache_tokens`` gives its
    KV-cache size (as 16-token blocks), which in-flight prompt tokens are measured against."""
    metrics = Metrics(
        waiting_queue_size=queue,
        running_requests=running,
        kv_cache_usage=kv,
        running_adapters=frozenset(running_adapters),
        waiting_adapters=frozenset(waiting_adapters),
        max_adapters=max_adapters,
        block_size=16 if cache_tokens else None,
        num_gpu_blocks=cache_tokens // 16 if cache_tokens else None,
        updated_at=SCRAPED_AT,
        stale=stale,
        error=None,
    )
    return Endpoint(f"pod-{i}", f"10.0.0.{i}", 8000, labels=dict(labels or {}), metrics=metrics, inflight=InFlight())


def request(*, adapter: str | None = None, headers: Mapping[str, str] | None = None, model: str = "m") -> InferenceRequest:
    return InferenceRequest(
        request_id="r", method="POST", path="/v1/completions", headers=dict(headers or {}), model=model, adapter=adapter
    )


def send(endpoint: Endpoint, count: int = 1, *, at: float = SCRAPED_AT + 1.0, tokens: int = 0) -> None:
    """Record ``count`` requests sent to ``endpoint`` at ``at`` (after its scrape, by default)."""
    record = endpoint.inflight
    assert isinstance(record, InFlight)
    for _ in range(count):
        record.add(tokens, now=at)


def names(endpoints: Iterable[Endpoint]) -> list[str]:
    return [e.name for e in endpoints]
