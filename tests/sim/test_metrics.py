from prometheus_client.parser import text_string_to_metric_families

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.metrics import Histogram, HttpStats, LoraInfoHistory, MetricsPage


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


def test_page_is_cached_until_something_changes() -> None:
    engine = Engine(EngineConfig(lora_adapters=('we"ird\\name',)))
    http = HttpStats()
    page = MetricsPage(engine, http)
    first = page.render()
    assert page.render() is first
    engine.version += 1
    second = page.render()
    assert second is not first and second == first
    http.record("/v1/completions", "POST", 200, 10, 20, 0.5)
    third = page.render().decode()
    assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1.0' in third
    families = {f.name for f in text_string_to_metric_families(third)}
    assert {"vllm:lora_requests_info", "http_request_duration_seconds", "python_info"} <= families


def test_lora_history_is_bounded_and_most_recent_last() -> None:
    history = LoraInfoHistory()
    for i in range(40):
        history.touch(f"a{i % 20}", "")
    history.touch("a5", "b")
    assert len(history) == 16
    assert next(reversed(history)) == ("a5", "b")
    assert max(history.items(), key=lambda kv: kv[1])[0] == ("a5", "b")
