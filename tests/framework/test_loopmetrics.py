"""The event loop's counters and gauges export what prometheus_client's do, write for write."""

from __future__ import annotations

import prometheus_client
from hypothesis import given
from hypothesis import strategies as st

from epp.framework.loopmetrics import LoopCounter, LoopGauge

_WRITES = st.lists(
    st.tuples(st.sampled_from(["inc", "dec", "set"]), st.sampled_from(["x", "y"]), st.floats(0, 1e6, allow_nan=False)),
    max_size=40,
)


def _samples(registry: prometheus_client.CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


@given(writes=_WRITES)
def test_a_counter_and_a_gauge_hold_what_prometheus_clients_hold(writes: list[tuple[str, str, float]]) -> None:
    ours, theirs = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    counter, reference_counter = (
        kind("c", "d", ["a"], registry=registry) for kind, registry in ((LoopCounter, ours), (prometheus_client.Counter, theirs))
    )
    gauge, reference_gauge = (
        kind("g", "d", ["a"], registry=registry) for kind, registry in ((LoopGauge, ours), (prometheus_client.Gauge, theirs))
    )
    for op, label, amount in writes:
        for g in (gauge, reference_gauge):
            getattr(g.labels(label), op)(amount)
        if op == "inc":
            for c in (counter, reference_counter):
                c.labels(label).inc(amount)
    assert _samples(ours) == _samples(theirs)


def test_an_unlabelled_counter_with_an_exemplar_and_a_tracked_gauge() -> None:
    registry = prometheus_client.CollectorRegistry()
    counter = LoopCounter("u", "d", registry=registry)
    counter.inc()
    counter.inc(2, {"trace_id": "abc"})
    gauge = LoopGauge("v", "d", registry=registry)
    with gauge.track_inprogress():
        assert registry.get_sample_value("v") == 1
    samples = {s.name: s for f in registry.collect() for s in f.samples}
    assert samples["u_total"].value == 3 and samples["u_total"].exemplar.labels == {"trace_id": "abc"}
    assert samples["v"].value == 0
