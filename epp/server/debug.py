"""``/debug/pool`` and ``/debug/config``: the picker's own view, for an operator asking why.

Off by default (``--enable-debug-endpoints``); when on, served on the metrics port next to
``/metrics`` (the port operators already reach, and that the metrics port's protection covers).
Both answer JSON:

* ``/debug/pool``: every endpoint of the pool with its labels, what it last reported (the scraped
  numbers, when, staleness and the scrape error if any), what it serves (its ``/v1/models`` base
  models and adapters, and how long ago they were read) and what this picker has in flight there
  (requests, estimated prompt tokens, unanswered, the learned prefill time per token), plus the
  derived loads scheduling reads (``queue_depth``, ``kv_usage``);
* ``/debug/config``: the effective configuration: every plugin by name with its type, the scheduling
  profiles with their filters, weighted scorers and picker, flow control on or off, the saturation
  detector, and the configuration text as given (or the default).

They read immutable snapshots on the metrics server's thread; nothing on the request path changes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from epp.framework import Endpoint
from epp.scheduling.config import DEFAULT_CONFIG, PickerConfig

__all__ = ["DebugViews"]


def _endpoint(endpoint: Endpoint, now: float) -> dict[str, Any]:
    metrics = asdict(endpoint.metrics)
    metrics["running_adapters"] = sorted(metrics["running_adapters"])
    metrics["waiting_adapters"] = sorted(metrics["waiting_adapters"])
    updated = metrics.pop("updated_at")
    inflight = endpoint.inflight
    return {
        "name": endpoint.name,
        "address": endpoint.hostport,
        "labels": dict(endpoint.labels),
        "metrics": metrics,
        "scraped_seconds_ago": round(now - updated, 3) if updated else None,
        "in_flight": {
            "requests": inflight.requests,
            "tokens": inflight.tokens,
            "unanswered": inflight.unanswered,
            "seconds_per_prompt_token": inflight.seconds_per_token,
        },
        "served": {
            "listed": endpoint.served.listed,
            "base_models": sorted(endpoint.served.base_models),
            "adapters": dict(sorted(endpoint.served.adapters.items())),
            "listed_seconds_ago": round(now - endpoint.served.updated_at, 3) if endpoint.served.updated_at else None,
        },
        "queue_depth": endpoint.queue_depth,
        "kv_usage": round(endpoint.kv_usage, 4),
    }


class DebugViews:
    """The two views, as ``path -> JSON bytes`` callables."""

    def __init__(
        self, endpoints: Callable[[], Sequence[Endpoint]], config: PickerConfig, config_text: str | None
    ) -> None:
        self._endpoints = endpoints
        self._config = config
        self._text = DEFAULT_CONFIG if config_text is None else config_text

    def pool(self) -> bytes:
        now = time.monotonic()
        endpoints = [_endpoint(e, now) for e in self._endpoints()]
        return json.dumps({"endpoints": endpoints, "count": len(endpoints)}, indent=1).encode()

    def config(self) -> bytes:
        config = self._config
        scheduler = config.scheduler
        profiles = [
            {
                "name": profile.name,
                "filters": [f.name for f in profile.filters],
                "scorers": [{"name": w.scorer.name, "weight": w.weight} for w in profile.scorers],
                "picker": profile.picker.name,
            }
            for profile in scheduler.profiles.values()
        ]
        view = {
            "plugins": {name: type_name for name, (type_name, _) in config.plugins.items()},
            "profiles": profiles,
            "profile_handler": getattr(scheduler.handler, "name", None),
            "flow_control": config.admission.flow_control_enabled,
            "saturation_detector": getattr(config.detector, "name", None),
            "objectives": dict(config.objectives),
            "config_text": self._text,
        }
        return json.dumps(view, indent=1).encode()

    def routes(self) -> dict[str, Callable[[], bytes]]:
        return {"/debug/pool": self.pool, "/debug/config": self.config}
