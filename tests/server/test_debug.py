"""/debug/pool and /debug/config on the metrics port: off by default, the picker's own view when on."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from epp.datalayer.static import parse_endpoints
from epp.server.server import EndpointPicker
from epp.server.settings import Settings
from tests.pickers import loopback_settings

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2}, {pluginRef: max-score-picker}]
"""


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


async def _picker(debug: bool) -> EndpointPicker:
    settings = loopback_settings(
        endpoints=tuple(parse_endpoints("127.0.0.1:1,127.0.0.1:2")),
        metrics_port=0,
        scrape_metrics=False,
        config_text=CONFIG,
        enable_debug_endpoints=debug,
    )
    picker = EndpointPicker(settings)
    await picker.start()
    return picker


async def test_debug_endpoints_show_the_pool_and_the_effective_config() -> None:
    picker = await _picker(True)
    try:
        port = picker.metrics_port
        status, body = await asyncio.to_thread(_get, port, "/debug/pool")
        assert status == 200
        pool = json.loads(body)
        assert pool["count"] == 2 and [e["address"] for e in pool["endpoints"]] == ["127.0.0.1:1", "127.0.0.1:2"]
        first = pool["endpoints"][0]
        assert first["metrics"]["stale"] is True and first["in_flight"]["requests"] == 0 and first["queue_depth"] == 0
        status, body = await asyncio.to_thread(_get, port, "/debug/config")
        config = json.loads(body)
        assert config["plugins"] == {"queue-scorer": "queue-scorer", "max-score-picker": "max-score-picker"}
        assert config["profiles"] == [
            {"name": "default", "filters": [], "scorers": [{"name": "queue-scorer", "weight": 2.0}], "picker": "max-score-picker"}
        ]
        assert config["flow_control"] is False and config["config_text"] == CONFIG
    finally:
        await picker.stop(grace=0)


@pytest.mark.parametrize("path", ["/debug/pool", "/debug/config"])
async def test_debug_endpoints_are_off_by_default(path: str) -> None:
    picker = await _picker(False)
    try:
        status, _ = await asyncio.to_thread(_get, picker.metrics_port, path)
        assert status == 404
    finally:
        await picker.stop(grace=0)


def test_the_pool_label_is_never_empty() -> None:
    endpoints = tuple(parse_endpoints("127.0.0.1:1"))
    assert Settings(endpoints=endpoints).pool_label == "static"
    assert Settings(endpoints=endpoints, pool_name="p").pool_label == "p"
    assert Settings(endpoint_selector=(("app", "vllm"),)).pool_label == "selector"
