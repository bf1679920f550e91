from prometheus_client.parser import text_string_to_metric_families

from epp.sim.config import EngineConfig
from epp.sim.engine import Engine
from epp.sim.metrics import HttpStats, MetricsPage


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
