"""epp.framework.histogram.Histogram, and the event loop's LoopHistogram, export what prometheus_client's Histogram
exports, observation for observation."""

from __future__ import annotations

import math

import prometheus_client
import pytest
from hypothesis import given
from hypothesis import strategies as st

from epp.framework.histogram import Histogram
from epp.framework.loopmetrics import LoopHistogram

KINDS = pytest.mark.parametrize("kind", [Histogram, LoopHistogram])

_AMOUNTS = st.one_of(
    st.floats(allow_nan=False, min_value=-1e6, max_value=1e6),
    st.sampled_from([0.0, -0.0, 1.0, 0.005, 2.5, math.inf, -math.inf, math.nan]),
)


def _samples(registry: prometheus_client.CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.append((sample.name, sample.labels, sample.value))
    return out


def _same(a: list[tuple[str, dict[str, str], float]], b: list[tuple[str, dict[str, str], float]]) -> bool:
    return len(a) == len(b) and all(
        x[:2] == y[:2] and (x[2] == y[2] or (math.isnan(x[2]) and math.isnan(y[2]))) for x, y in zip(a, b, strict=True)
    )


@KINDS
@given(
    bounds=st.lists(st.floats(allow_nan=False, allow_infinity=False, min_value=-1e3, max_value=1e3), min_size=1,
                    max_size=12, unique=True).map(sorted),
    amounts=st.lists(_AMOUNTS, max_size=40),
    bounds_too=st.booleans(),
)  # fmt: skip
def test_every_bucket_count_and_sum_are_prometheus_clients(
    kind: type[Histogram], bounds: list[float], amounts: list[float], bounds_too: bool
) -> None:
    if bounds_too:  # observations exactly on a bound go in that bound's bucket (le: less or equal)
        amounts = amounts + bounds
    ours, theirs = prometheus_client.CollectorRegistry(), prometheus_client.CollectorRegistry()
    mine = kind("h", "d", ["a"], buckets=bounds, registry=ours).labels("x")
    reference = prometheus_client.Histogram("h", "d", ["a"], buckets=bounds, registry=theirs).labels("x")
    for amount in amounts:
        mine.observe(amount)
        reference.observe(amount)
    assert _same(_samples(ours), _samples(theirs))


@KINDS
def test_an_unlabelled_histogram_and_an_exemplar_are_observed_too(kind: type[Histogram]) -> None:
    registry = prometheus_client.CollectorRegistry()
    histogram = kind("u", "d", buckets=(1.0, 2.0), registry=registry)
    histogram.observe(1.5)
    samples = {(s.name, s.labels.get("le")): s for f in registry.collect() for s in f.samples}
    assert samples[("u_bucket", "1.0")].value == 0 and samples[("u_bucket", "2.0")].value == 1
    assert samples[("u_sum", None)].value == 1.5
    labelled = kind("e", "d", ["a"], buckets=(1.0,), registry=registry).labels("x")
    labelled.observe(0.5, {"trace_id": "abc"})
    exemplars = [s.exemplar for f in registry.collect() for s in f.samples if s.name == "e_bucket" and s.exemplar]
    assert exemplars and exemplars[0].labels == {"trace_id": "abc"}


@KINDS
def test_observing_a_labelled_parent_is_prometheus_clients_error(kind: type[Histogram]) -> None:
    parent = kind("p", "d", ["a"], registry=prometheus_client.CollectorRegistry())
    with pytest.raises(ValueError, match="missing label values"):
        parent.observe(1.0)
