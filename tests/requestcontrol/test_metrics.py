"""The request series (epp.requestcontrol.metrics): bounded model labels, whatever clients send."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint, Handle, InferenceRequest, Metrics, PluginMetrics
from epp.requestcontrol.director import Director
from epp.requestcontrol.metrics import (
    MAX_FIRST_SEEN_MODEL_LABELS,
    MAX_MODEL_LABEL_CHARS,
    OTHER_MODEL,
    RequestMetrics,
)
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry

_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: random-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: random-picker
"""


def _model_labels(registry: CollectorRegistry) -> set[str]:
    return {
        sample.labels["model_name"]
        for family in registry.collect()
        for sample in family.samples
        if sample.labels.get("model_name")
    }


def test_the_first_names_get_labels_then_every_other_name_is_other() -> None:
    metrics = RequestMetrics()
    for n in range(1_000):
        metrics.for_model(f"model-{n}").requests.inc()
    labels = _model_labels(metrics.registry)
    assert labels == {f"model-{n}" for n in range(MAX_FIRST_SEEN_MODEL_LABELS)} | {OTHER_MODEL}
    other = metrics.registry.get_sample_value(
        "inference_objective_request_total", {"model_name": OTHER_MODEL, "target_model_name": OTHER_MODEL}
    )
    assert other == 1_000 - MAX_FIRST_SEEN_MODEL_LABELS
    # a name that has its label keeps it
    assert metrics.for_model("model-0") is metrics.for_model("model-0")
    assert metrics.for_model("model-0") is not metrics.for_model("model-999")


def test_a_10_kb_model_name_never_becomes_a_label() -> None:
    metrics = RequestMetrics()
    metrics.for_model("x" * 10_000).requests.inc()
    metrics.for_model("y" * (MAX_MODEL_LABEL_CHARS + 1), served=lambda: True).requests.inc()
    metrics.for_model("z" * MAX_MODEL_LABEL_CHARS).requests.inc()
    assert _model_labels(metrics.registry) == {OTHER_MODEL, "z" * MAX_MODEL_LABEL_CHARS}


def test_a_served_model_gets_its_label_after_the_first_seen_ones_ran_out() -> None:
    metrics = RequestMetrics()
    for n in range(MAX_FIRST_SEEN_MODEL_LABELS + 5):
        metrics.for_model(f"junk-{n}")
    asked: list[str] = []

    def served() -> bool:
        asked.append("real")
        return True

    metrics.for_model("real", served=served).requests.inc()
    assert "real" in _model_labels(metrics.registry)
    metrics.for_model("real", served=served)
    assert asked == ["real"]  # asked once: a name with a label is not asked again
    assert "junk-40" not in _model_labels(metrics.registry)


async def test_the_director_labels_the_adapters_the_pods_report_as_served() -> None:
    pod = Endpoint("pod-a", "10.0.0.1", 8000, metrics=Metrics(running_adapters=frozenset({"lora-a"})))
    datastore = Datastore([pod])
    metrics = RequestMetrics()
    built = load_config(_CONFIG, default_registry(), Handle(datastore, metrics=PluginMetrics(CollectorRegistry())))
    director = Director(datastore, built.scheduler, metrics)

    async def route(model: str) -> None:
        request = InferenceRequest("r", "POST", "/v1/completions", {}, model=model, prompt="p")
        (await director.route(request)).finish()

    for n in range(MAX_FIRST_SEEN_MODEL_LABELS + 10):  # a client invents names first
        await route(f"invented-{n}")
    await route("lora-a")
    await route("invented-99")
    labels = _model_labels(metrics.registry)
    assert "lora-a" in labels and OTHER_MODEL in labels
    assert len(labels) == MAX_FIRST_SEEN_MODEL_LABELS + 2


def test_public_names() -> None:
    import epp.requestcontrol.metrics

    assert sorted(epp.requestcontrol.metrics.__all__) == [
        "MAX_FIRST_SEEN_MODEL_LABELS", "MAX_MODEL_LABEL_CHARS", "MAX_SERVED_MODEL_LABELS", "ModelMetrics",
        "OTHER_MODEL", "RequestMetrics", "STREAM_CODES", "StreamMetrics",
    ]  # fmt: skip


def test_a_refusal_after_parsing_is_counted_under_the_parsed_model() -> None:
    from epp.errors import EppError, Reason

    metrics = RequestMetrics()
    metrics.refused(EppError(Reason.NO_ENDPOINT, "none"), "llama")
    metrics.refused(EppError(Reason.BAD_REQUEST, "not json"))
    value = metrics.registry.get_sample_value
    labels = {"model_name": "llama", "target_model_name": "llama", "error_code": "no_endpoint"}
    assert value("inference_objective_request_error_total", labels) == 1
    assert value("inference_objective_request_error_total", {"model_name": "", "target_model_name": "", "error_code": "bad_request"}) == 1
    huge = "x" * 10_000
    metrics.refused(EppError(Reason.NO_ENDPOINT, "none"), huge)  # a client's 10 KB name is no label
    assert value("inference_objective_request_error_total", {"model_name": "other", "target_model_name": "other", "error_code": "no_endpoint"}) == 1
