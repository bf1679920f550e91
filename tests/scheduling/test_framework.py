"""The scheduling framework around the plugins: producers and data declarations, profile handlers,
lifecycle hooks through the director, plugin timing, entry-point loading and turning plugins off."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from epp.scheduling.config import ConfigError, load_config, load_scheduler
from epp.datalayer.datastore import Datastore, Endpoint, Metrics, parse_endpoint
from epp.requestcontrol.director import Director
from epp.server.metrics import Metrics as PickerMetrics
from epp.scheduling.registry import ENTRY_POINT_GROUP, Handle, PluginLoadError, Registry, default_registry, load_registry
from epp.extproc.parsing import InferenceRequest
from epp.scheduling.runner import Profile, ScoredEndpoint, Scheduler, SchedulingResult, roles

ENDPOINTS = tuple(
    Endpoint(e.name, e.address, e.port, metrics=Metrics(stale=False))
    for e in (parse_endpoint(f"10.0.0.{i}:8000") for i in range(1, 4))
)
E1, E2, E3 = ENDPOINTS


def request(prompt: str = "", **headers: str) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers=headers, model="m", prompt=prompt)


def config(plugins: str, profiles: str | None = None) -> str:
    text = f"apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n{plugins}\n"
    return text + (f"schedulingProfiles:\n{profiles}\n" if profiles is not None else "")


# -- fakes written against the public API ----------------------------------------------------------

calls: list[str] = []


class Producer:
    def __init__(self, name: str, produces: tuple[str, ...], consumes: tuple[str, ...] = ()) -> None:
        self.name, self.produces, self.consumes = name, produces, consumes

    def produce(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        calls.append(f"produce:{self.name}")
        for data in self.consumes:
            assert data in req.state, f"{self.name} ran before the producer of {data}"
        for data in self.produces:
            req.state[data] = {e.name: float(i == 0) for i, e in enumerate(candidates)}


class Consumer:
    """A scorer scoring from the data it consumes."""

    def __init__(self, name: str, data: str) -> None:
        self.name, self.consumes, self.data = name, (data,), data

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        calls.append(f"score:{self.name}")
        return [req.state[self.data][e.name] for e in candidates]


class FilterAndScorer:
    """Two roles in one plugin: drops E3, and prefers E2."""

    name = "both"

    def filter(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if e != E3]

    def score(self, req: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return [1.0 if e == E2 else 0.0 for e in candidates]


class TwoStepHandler:
    """Runs profile ``a``, then ``b``; the request goes by ``b``."""

    name = "two-step"

    def pick_profiles(self, req: InferenceRequest, profiles: Mapping[str, Profile], results: Mapping[str, list[Endpoint]]) -> list[Profile]:
        calls.append(f"handler:{sorted(results)}")
        if not results:
            return [profiles["a"]]
        if "b" not in results:
            return [profiles["b"]]
        return []

    def process_results(self, req: InferenceRequest, results: Mapping[str, list[Endpoint]]) -> str:
        return "b"


class OnlyPicker:
    """Picks one fixed endpoint (by hostport) when it is a candidate."""

    def __init__(self, name: str, hostport: str) -> None:
        self.name, self.hostport = name, hostport

    def pick(self, req: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        return [s.endpoint for s in scored if s.endpoint.hostport == self.hostport]


class Hooks:
    name = "hooks"

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def pre_request(self, req: InferenceRequest, result: SchedulingResult) -> None:
        # In-flight accounting is already counting this request when plugins hear of the pick.
        self.events.append(("pre", result.endpoints[0].name, result.endpoints[0].inflight.requests))

    def response_received(self, req: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]) -> dict[str, str]:
        self.events.append(("headers", endpoint.name, headers.get(":status")))
        return {"x-served-by": endpoint.name}

    def response_complete(self, req: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        self.events.append(("complete", endpoint.name, outcome, endpoint.inflight.requests))


class Broken:
    name = "broken"

    def pre_request(self, req: InferenceRequest, result: SchedulingResult) -> None:
        raise RuntimeError("plugin bug")

    def response_complete(self, req: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        raise RuntimeError("plugin bug")


def registry_with(**factories: Any) -> Registry:
    registry = default_registry()
    for type_name, factory in factories.items():
        registry.register(type_name.replace("_", "-"), factory, source="tests")
    return registry


def test_roles_are_found_by_method() -> None:
    assert roles(FilterAndScorer()) == ["Filter", "Scorer"]
    assert roles(Hooks()) == ["PreRequest", "ResponseReceived", "ResponseComplete"]
    assert roles(TwoStepHandler()) == ["ProfileHandler"]
    assert roles(object()) == []


# -- producers and data declarations ----------------------------------------------------------------


def test_producers_run_first_in_dependency_order() -> None:
    registry = registry_with(
        # "second" consumes what "first" produces, and is listed before it.
        second=lambda n, p, h: Producer(n, ("b",), consumes=("a",)),
        first=lambda n, p, h: Producer(n, ("a",)),
        consumer=lambda n, p, h: Consumer(n, "b"),
    )
    text = config(
        "- type: second\n- type: first\n- type: consumer\n- type: max-score-picker",
        "- name: p\n  plugins:\n  - pluginRef: consumer\n  - pluginRef: max-score-picker",
    )
    calls.clear()
    picked = load_scheduler(text, registry, Handle(Datastore())).schedule(request(), ENDPOINTS)
    assert calls == ["produce:first", "produce:second", "score:consumer"]
    assert picked == [E1]  # the consumer scored from the data: E1 has 1.0


def test_a_producer_cycle_is_refused() -> None:
    registry = registry_with(
        x=lambda n, p, h: Producer(n, ("a",), consumes=("b",)), y=lambda n, p, h: Producer(n, ("b",), consumes=("a",))
    )
    with pytest.raises(ConfigError, match=r"data producers depend on each other in a cycle: x -> y -> x"):
        load_scheduler(config("- type: x\n- type: y\n- type: random-picker"), registry, Handle(Datastore()))


def test_consuming_data_nobody_produces_is_refused() -> None:
    registry = registry_with(consumer=lambda n, p, h: Consumer(n, "mystery"))
    with pytest.raises(ConfigError) as info:
        load_scheduler(config("- type: consumer"), registry, Handle(Datastore()))
    assert str(info.value) == "plugins: 'consumer' consumes 'mystery', which no configured plugin produces"


def test_prefix_cache_scorer_alone_brings_its_producer_with_its_parameters() -> None:
    text = config(
        "- type: prefix-cache-scorer\n  parameters:\n    blockSizeTokens: 4\n    lruCapacityPerServer: 7",
        "- name: p\n  plugins:\n  - pluginRef: prefix-cache-scorer",
    )
    built = load_config(text, default_registry(), Handle(Datastore()))
    assert built.plugins["approx-prefix-cache-producer"][0] == "approx-prefix-cache-producer"
    producer = built.plugins["approx-prefix-cache-producer"][1]
    assert (producer.parameters.block_size_tokens, producer.parameters.lru_capacity_per_server) == (4, 7)


# -- profiles and handlers --------------------------------------------------------------------------


def test_a_profile_handler_runs_several_profiles() -> None:
    registry = registry_with(
        two_step=lambda n, p, h: TwoStepHandler(),
        only=lambda n, p, h: OnlyPicker(n, p["hostport"]),
    )
    text = config(
        "- type: two-step\n"
        "- name: pick-1\n  type: only\n  parameters: {hostport: '10.0.0.1:8000'}\n"
        "- name: pick-2\n  type: only\n  parameters: {hostport: '10.0.0.2:8000'}",
        "- name: a\n  plugins:\n  - pluginRef: pick-1\n- name: b\n  plugins:\n  - pluginRef: pick-2",
    )
    scheduler = load_scheduler(text, registry, Handle(Datastore()))
    calls.clear()
    result = scheduler.run(request(), ENDPOINTS)
    assert calls == ["handler:[]", "handler:['a']", "handler:['a', 'b']"]
    assert dict(result.profile_results) == {"a": [E1], "b": [E2]}
    assert (result.primary_profile, result.endpoints) == ("b", [E2])


def test_a_profile_without_picker_gets_max_score_picker_and_a_scorer_weight_1() -> None:
    text = config("- type: queue-scorer", "- name: p\n  plugins:\n  - pluginRef: queue-scorer")
    profile = load_scheduler(text, default_registry(), Handle(Datastore())).profile
    assert type(profile.picker).__name__ == "MaxScorePicker"
    assert [(w.scorer.name, w.weight) for w in profile.scorers] == [("queue-scorer", 1.0)]


def test_no_profiles_means_one_default_profile_with_every_plugin() -> None:
    registry = registry_with(both=lambda n, p, h: FilterAndScorer())
    scheduler = load_scheduler(config("- type: both\n- type: max-score-picker"), registry, Handle(Datastore()))
    profile = scheduler.profile
    assert profile.name == "default"
    assert [f.name for f in profile.filters] == ["both"]  # one plugin, two roles
    assert [w.scorer.name for w in profile.scorers] == ["both"]
    for _ in range(10):
        assert scheduler.schedule(request(), ENDPOINTS) == [E2]


def test_weight_on_a_non_scorer_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    text = config("- type: random-picker", "- name: p\n  plugins:\n  - pluginRef: random-picker\n    weight: 3")
    with caplog.at_level(logging.WARNING):
        load_scheduler(text, default_registry(), Handle(Datastore()))
    assert "weight given to 'random-picker', which is not a scorer: ignored" in caplog.text


def test_upstream_old_type_name_kv_cache_scorer_loads() -> None:
    text = config("- type: kv-cache-scorer", "- name: p\n  plugins:\n  - pluginRef: kv-cache-scorer")
    built = load_config(text, default_registry(), Handle(Datastore()))
    assert built.plugins["kv-cache-scorer"][0] == "kv-cache-utilization-scorer"


# -- plugin timing ----------------------------------------------------------------------------------


def test_every_plugin_call_is_timed_with_its_type_and_name() -> None:
    seen: list[tuple[str, str, str]] = []

    def timer(point: str, plugin_type: str, plugin_name: str) -> Any:
        return lambda seconds: seen.append((point, plugin_type, plugin_name)) if seconds >= 0 else None

    text = config(
        "- type: low-queue-filter\n- name: q\n  type: queue-scorer\n- type: prefix-cache-scorer\n- type: max-score-picker",
        "- name: p\n  plugins:\n  - pluginRef: low-queue-filter\n  - pluginRef: q\n  - pluginRef: prefix-cache-scorer\n"
        "  - pluginRef: max-score-picker",
    )
    scheduler = load_config(text, default_registry(), Handle(Datastore()), timer=timer).scheduler
    result = scheduler.run(request("x" * 200), ENDPOINTS)
    scheduler.pre_request(request(), result)
    assert seen == [
        ("DataProducer", "approx-prefix-cache-producer", "approx-prefix-cache-producer"),
        ("Filter", "low-queue-filter", "low-queue-filter"),
        ("Scorer", "queue-scorer", "q"),
        ("Scorer", "prefix-cache-scorer", "prefix-cache-scorer"),
        ("Picker", "max-score-picker", "max-score-picker"),
        ("PreRequest", "approx-prefix-cache-producer", "approx-prefix-cache-producer"),
    ]


def test_service_metrics_record_plugin_durations_and_attempts() -> None:
    metrics = PickerMetrics()
    datastore = Datastore(ENDPOINTS)
    built = load_config(None, default_registry(), Handle(datastore, registry=metrics.registry), timer=metrics.plugin_timer)
    director = Director(datastore, built.scheduler, metrics)
    routing = asyncio.run(director.route(request("y" * 300)))
    routing.finish()
    value = metrics.registry.get_sample_value
    assert value(
        "inference_extension_plugin_duration_seconds_count",
        {"extension_point": "Scorer", "plugin_type": "queue-scorer", "plugin_name": "queue-scorer"},
    ) == 1
    assert value("inference_extension_scheduler_attempts_total", {"status": "success"}) == 1
    assert value("inference_extension_prefix_indexer_size") == 300 // 64


# -- the request lifecycle through the director -------------------------------------------------------


def _director(*plugins: object, endpoints: Sequence[Endpoint] = ENDPOINTS) -> tuple[Director, Datastore]:
    datastore = Datastore(endpoints)
    scheduler = Scheduler(Profile("p", OnlyPicker("only", E2.hostport)), hooks=plugins)
    return Director(datastore, scheduler, PickerMetrics()), datastore


@pytest.mark.parametrize(("status", "outcome", "expected"), [("200", "complete", "complete"), ("503", "complete", "error"), ("200", "cancelled", "cancelled")])
def test_lifecycle_hooks_and_in_flight_accounting(status: str, outcome: str, expected: str) -> None:
    hooks = Hooks()
    director, datastore = _director(hooks)
    routing = asyncio.run(director.route(request()))
    endpoint = datastore.get(E2.name)
    assert endpoint is not None and endpoint.inflight.requests == 1
    assert routing.response_headers({":status": status}) == {"x-served-by": E2.name}
    routing.finish(outcome)
    routing.finish("error")  # a second finish changes nothing
    assert hooks.events == [("pre", E2.name, 1), ("headers", E2.name, status), ("complete", E2.name, expected, 0)]
    assert endpoint.inflight.requests == 0


def test_a_failing_hook_is_logged_and_the_request_still_routes(caplog: pytest.LogCaptureFixture) -> None:
    director, datastore = _director(Broken())
    with caplog.at_level(logging.ERROR):
        routing = asyncio.run(director.route(request()))
        routing.finish()
    assert routing.destination == E2.hostport
    assert "a pre-request plugin failed" in caplog.text and "a response-complete plugin failed" in caplog.text
    assert datastore.get(E2.name).inflight.requests == 0  # released despite the failing hook


def test_in_flight_requests_steer_the_default_profile_between_scrapes() -> None:
    # Three idle pods, scraped at t=0; a burst of 30 routed before the next scrape must spread out.
    idle = Metrics(updated_at=0.0, stale=False, num_gpu_blocks=1000, block_size=16)
    pods = [Endpoint(f"pod-{i}", f"10.0.1.{i}", 8000, metrics=idle) for i in range(3)]
    datastore = Datastore(pods)
    metrics = PickerMetrics()
    scheduler = load_config(None, default_registry(), Handle(datastore)).scheduler
    director = Director(datastore, scheduler, metrics)

    async def burst() -> list[str]:
        return [(await director.route(request(f"question {i} " * 20))).endpoints[0].name for i in range(30)]

    picked = asyncio.run(burst())
    counts = {name: picked.count(name) for name in {p.name for p in pods}}
    assert sorted(counts.values()) == [10, 10, 10], counts


# -- entry points and turning plugins off -----------------------------------------------------------


class FakeDist:
    def __init__(self, name: str) -> None:
        self.name, self.version = name, "1.0"


class FakeEntryPoint:
    def __init__(self, name: str, target: Any, dist: str) -> None:
        self.name, self._target, self.dist = name, target, FakeDist(dist)
        self.value, self.module, self.group = f"{dist}.plugins:factory", f"{dist}.plugins", ENTRY_POINT_GROUP

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def _epp_entry_point() -> FakeEntryPoint:
    return FakeEntryPoint("max-score-picker", lambda n, p, h: OnlyPicker(n, ""), "epp")


def test_entry_points_register_with_their_distribution() -> None:
    registry = load_registry(entry_points=[_epp_entry_point(), FakeEntryPoint("acme-scorer", lambda n, p, h: None, "acme")])
    assert registry.types() == ["acme-scorer", "max-score-picker"]
    assert registry.source("acme-scorer") == "acme 1.0"


def test_a_type_offered_by_two_distributions_stops_startup_naming_both() -> None:
    points = [_epp_entry_point(), FakeEntryPoint("max-score-picker", lambda n, p, h: None, "acme")]
    with pytest.raises(PluginLoadError) as info:
        load_registry(entry_points=points)
    assert str(info.value) == "plugin type 'max-score-picker' is offered twice: by epp 1.0 and by acme 1.0"


def test_a_broken_plugin_names_itself_and_can_be_disabled() -> None:
    points = [_epp_entry_point(), FakeEntryPoint("bad-scorer", ImportError("no module named torch"), "acme")]
    with pytest.raises(PluginLoadError, match=r"plugin type 'bad-scorer' from acme 1\.0 failed to load .*--disable-plugin bad-scorer"):
        load_registry(entry_points=points)
    registry = load_registry(["bad-scorer"], entry_points=points)
    assert registry.types() == ["max-score-picker"]
    with pytest.raises(KeyError, match="plugin type 'bad-scorer' is disabled"):
        registry.create("bad-scorer", "b", {}, Handle(Datastore()))


def test_the_installed_entry_points_are_the_built_ins() -> None:
    registry = default_registry()
    assert all(registry.source(name).startswith("epp ") for name in registry.types() if not name.startswith("example-"))


def test_disable_plugin_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from epp.server.cli import settings_from_args

    monkeypatch.setenv("EPP_DISABLE_PLUGINS", "session-affinity-scorer, load-aware-scorer")
    settings, _ = settings_from_args(["--disable-plugin", "prefix-cache-scorer", "--disable-plugin=a,b"])
    assert settings.disabled_plugins == ("a", "b", "load-aware-scorer", "prefix-cache-scorer", "session-affinity-scorer")


def test_the_readme_and_deploy_configs_load() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```yaml\n")[1:]]
    texts = [b for b in blocks if "kind: EndpointPickerConfig" in b]
    texts += [p.read_text() for p in sorted((root / "deploy" / "config").glob("*.yaml"))]
    assert len(texts) >= 5
    for text in texts:
        load_config(text, default_registry(), Handle(Datastore()))


def test_a_request_counts_as_unanswered_until_its_response_body_starts() -> None:
    director, datastore = _director()
    endpoint = datastore.get(E2.name)
    first = asyncio.run(director.route(request()))
    second = asyncio.run(director.route(request()))
    assert (endpoint.inflight.requests, endpoint.inflight.unanswered) == (2, 2)
    first.response_headers({":status": "200"})  # streamed responses send headers before prefill ends
    assert endpoint.inflight.unanswered == 2
    first.response_body_started()
    first.response_body_started()  # once per request
    assert (endpoint.inflight.requests, endpoint.inflight.unanswered) == (2, 1)
    first.finish()
    second.finish("cancelled")  # never answered: released from both counts
    assert (endpoint.inflight.requests, endpoint.inflight.unanswered) == (0, 0)
