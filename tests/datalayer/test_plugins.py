"""The data layer in an EndpointPickerConfig: metrics-data-source and core-metrics-extractor."""

from __future__ import annotations

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Handle
from epp.scheduling.config import ConfigError, load_config
from epp.scheduling.registry import default_registry
from epp.server.server import EndpointPicker
from epp.server.settings import Settings

HANDLE = Handle(Datastore())

UPSTREAM_STYLE = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: metrics-data-source
  parameters: {scheme: https, path: /stats, insecureSkipVerify: false}
- type: core-metrics-extractor
  parameters:
    defaultEngine: spoke
    engineLabelKey: llm-d.ai/engine-type
    engineConfigs:
    - name: spoke
      queuedRequestsSpec: "inference_pool_average_queue_size"
      kvUsageSpec: "inference_pool_average_kv_cache_utilization"
    - name: vllm
      queuedRequestsSpec: 'vllm:num_requests_waiting{model_name="llama"}'
      runningRequestsSpec: "vllm:num_requests_running"
- type: random-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: random-picker}]
{data_key}:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
"""


@pytest.mark.parametrize("data_key", ["data", "dataLayer"])
def test_upstream_data_layer_config_loads(data_key: str) -> None:
    config = load_config(UPSTREAM_STYLE.replace("{data_key}", data_key), default_registry(), HANDLE)
    source, extractor = config.metrics_source, config.metrics_extractor
    assert (source.scheme, source.path, source.insecure_skip_verify) == ("https", "/stats", False)
    assert extractor.default_engine == "spoke" and extractor.engine_label_key == "llm-d.ai/engine-type"
    assert {"vllm", "sglang", "trtllm-serve", "triton-tensorrt-llm", "spoke"} <= set(extractor.engines)
    page = b'inference_pool_average_queue_size 4\ninference_pool_average_kv_cache_utilization 0.5\n'
    parsed = extractor.engines["spoke"].parse(page)
    assert (parsed.waiting_queue_size, parsed.kv_cache_usage, parsed.missing) == (4, 0.5, ())
    # An entry named like a built-in replaces it: only what it lists is read.
    vllm = extractor.engines["vllm"].parse(
        b'vllm:num_requests_waiting{model_name="llama"} 2\nvllm:num_requests_waiting{model_name="other"} 9\n'
        b"vllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.9\n"
    )
    assert (vllm.waiting_queue_size, vllm.running_requests, vllm.kv_cache_usage) == (2, 1, None)


@pytest.mark.parametrize(
    ("plugins", "message"),
    [
        ("- type: core-metrics-extractor\n  parameters: {engineConfig: []}", "unknown parameter(s) ['engineConfig']"),
        ("- type: core-metrics-extractor\n  parameters: {defaultEngine: nope}", "defaultEngine 'nope' is not one of"),
        (
            "- type: core-metrics-extractor\n  parameters:\n    engineConfigs: [{name: x, queuedSpec: q}]",
            "engine 'x': unknown key 'queuedSpec'",
        ),
        (
            "- type: core-metrics-extractor\n  parameters:\n    engineConfigs: [{name: x, kvUsageSpec: 'a{b'}]",
            "engine 'x': kvUsageSpec:",
        ),
        ("- type: metrics-data-source\n  parameters: {scheme: ftp}", "scheme must be http or https"),
        ("- type: metrics-data-source\n  parameters: {path: metrics}", "path must start with /"),
    ],
)
def test_data_layer_mistakes_are_named(plugins: str, message: str) -> None:
    text = (
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
        f"{plugins}\n- type: random-picker\nschedulingProfiles:\n- name: d\n  plugins: [{{pluginRef: random-picker}}]\n"
    )
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        load_config(text, default_registry(), HANDLE)


def test_data_section_must_reference_data_plugins() -> None:
    text = UPSTREAM_STYLE.replace("{data_key}", "data").replace(
        "extractors:\n    - pluginRef: core-metrics-extractor", "extractors:\n    - pluginRef: random-picker"
    )
    with pytest.raises(ConfigError, match=r"data.sources\[0\].extractors\[0\]: pluginRef 'random-picker' names no core-metrics-extractor"):
        load_config(text, default_registry(), HANDLE)


def test_the_picker_scrapes_as_the_config_file_says() -> None:
    settings = Settings(config_text=UPSTREAM_STYLE.replace("{data_key}", "data"), metrics_port=-1)
    picker = EndpointPicker(settings)
    assert picker.scraper is not None
    assert picker.scraper._default_engine == "spoke"
    assert picker.scraper._engine_label == "llm-d.ai/engine-type"
