"""The scrape loops (epp.datalayer.loops) on their own: what they report, their phases, their settings."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from epp.datalayer.datastore import Metrics
from epp.datalayer.engines import builtin_engines
from epp.datalayer.loops import ScrapeLoops, Target

from ._scraping import FAST, FakeServer, until


async def test_the_loops_report_metrics_fields_in_order(fake: FakeServer) -> None:
    # What ScrapeLoops hands its sink (and the worker ships): a tuple of Metrics' fields, in order.
    reports: list[tuple[str, tuple[object, ...], str | None]] = []
    loops = ScrapeLoops(builtin_engines(), FAST, lambda *report: reports.append(report))
    loops.add(Target("pod", "127.0.0.1", fake.port, "vllm"))
    try:
        await until(lambda: len(reports) >= 2)
    finally:
        await loops.stop()
    name, values, reason = reports[-1]
    assert (name, reason, len(values)) == ("pod", None, len(fields(Metrics)))
    metrics = Metrics(*values)
    assert (metrics.waiting_queue_size, metrics.num_gpu_blocks, metrics.stale, metrics.error) == (7, 1000, False, None)
    assert loops.endpoints == {}


async def test_loops_are_spread_evenly_over_the_interval() -> None:
    # 20 ms at 5 ms a slot: 4 phases. New loops take the emptiest one, so 8 loops are 2 per phase.
    loops = ScrapeLoops(builtin_engines(), FAST, lambda *report: None)
    try:
        for i in range(8):
            loops.add(Target(f"pod-{i}", "127.0.0.1", 9, "vllm"))
        slots = [endpoint.slot for endpoint in loops.endpoints.values()]
        assert sorted(slots) == [0, 0, 1, 1, 2, 2, 3, 3]
        loops.remove("pod-5")
        loops.add(Target("pod-8", "127.0.0.1", 9, "vllm"))
        assert loops.endpoints["pod-8"].slot == slots[5]  # the phase that lost a loop
    finally:
        await loops.stop()


@pytest.mark.parametrize("bad", [{"interval": 0.0}, {"timeout": -1.0}, {"staleness": 0.0}])
def test_settings_that_cannot_work_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        ScrapeLoops(builtin_engines(), replace(FAST, **bad), lambda *report: None)
