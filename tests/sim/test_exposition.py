"""The text format as prometheus_client writes it, and the name filter of ``/metrics?name[]=...``."""

from prometheus_client.parser import text_string_to_metric_families

from epp.sim.exposition import Histogram, restrict_page


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    h = Histogram("x_seconds", "doc", (0.1, 1, 10), {"engine": "0"}, created=1.0)
    for v in (0.1, 0.5, 1.0, 20.0):
        h.observe(v)
    h.observe(5.0, n=3)
    assert h.bucket_counts() == [1, 3, 6, 7]
    family, created = text_string_to_metric_families(h.render())
    assert created.name == "x_seconds_created" and created.samples[0].value == 1.0
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "x_seconds_bucket"}
    assert buckets == {"0.1": 1, "1.0": 3, "10.0": 6, "+Inf": 7}
    assert h.count == 7 and h.sum == 36.6


def test_restrict_page_keeps_headers_and_drops_longer_names() -> None:
    page = (
        b"# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
        b"# HELP a x\n# TYPE a gauge\na{l=\"v\"} 2\na 3\n"
        b"# TYPE ab gauge\nab 4\n"
    )
    assert restrict_page(page, [b"a"]) == b'# HELP a x\n# TYPE a gauge\na{l="v"} 2\na 3\n'
    assert restrict_page(page, [b"zz"]) == b""
