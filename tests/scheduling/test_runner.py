"""The runner isolates every plugin call: a failing or malformed plugin never fails a request."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from epp.framework import (
    Endpoint,
    InferenceRequest,
    Profile,
    SchedulingResult,
    ScoredEndpoint,
    StateKey,
    WeightedScorer,
)
from epp.scheduling.metrics import PluginCallMetrics
from epp.scheduling.runner import Scheduler

E1, E2, E3 = (Endpoint(f"e{i}", f"10.0.0.{i}", 8000) for i in (1, 2, 3))
PODS = (E1, E2, E3)
REQUEST = InferenceRequest(request_id="r", method="POST", path="/v1/completions")
SEEN: StateKey[list[str]] = StateKey("seen")


class Fixed:
    """A scorer preferring one endpoint."""

    def __init__(self, name: str, best: Endpoint) -> None:
        self.name, self.best = name, best

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return [1.0 if e == self.best else 0.0 for e in candidates]


class Raises:
    """Every role, each raising."""

    name = "raises"

    def produce(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        raise RuntimeError("producer bug")

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        raise RuntimeError("filter bug")

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        raise RuntimeError("scorer bug")

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        raise RuntimeError("picker bug")

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        raise RuntimeError("hook bug")

    def response_received(self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]) -> None:
        raise RuntimeError("hook bug")

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        raise RuntimeError("hook bug")


class Returns:
    """A scorer returning whatever it was given."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Any:
        return self.value

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Any:
        return self.value

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> Any:
        return self.value


class Recorder:
    """Hooks that record they ran."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list[str] = []

    def produce(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        self.events.append("produce")

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self.events.append("pre")

    def response_received(self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]) -> dict:
        self.events.append("headers")
        return {"x-ok": "1"}

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        self.events.append(f"complete:{outcome}")


class Best:
    """The max-score picker, minimal."""

    name = "best"

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        return [max(scored, key=lambda item: item.score).endpoint]


def errors(metrics: PluginCallMetrics, point: str, name: str, kind: str = "exception") -> float:
    labels = {"extension_point": point, "plugin_type": name, "plugin_name": name, "kind": kind}
    return metrics.registry.get_sample_value("epp_plugin_errors_total", labels) or 0.0


def scheduler(profile: Profile, *, hooks: Sequence[object] = (), producers: Sequence[Any] = ()) -> tuple[Scheduler, PluginCallMetrics]:
    metrics = PluginCallMetrics()
    types = {p.name: p.name for p in [*hooks, *producers, profile.picker, *profile.filters, *(w.scorer for w in profile.scorers)]}
    return Scheduler(profile, hooks=hooks, producers=producers, instrument=metrics.instrument(types)), metrics


def test_a_raising_scorer_scores_zero_and_the_others_decide(caplog: pytest.LogCaptureFixture) -> None:
    profile = Profile("p", Best(), scorers=(WeightedScorer(Raises(), 5.0), WeightedScorer(Fixed("fixed", E3), 1.0)))
    run, metrics = scheduler(profile)
    with caplog.at_level(logging.ERROR):
        assert run.schedule(REQUEST, PODS) == [E3]
    assert errors(metrics, "Scorer", "raises") == 1
    assert "Scorer plugin 'raises' failed; scored 0" in caplog.text and "scorer bug" in caplog.text


@pytest.mark.parametrize("value", [[None, 1.0, 0.0], ["a", "b", "c"], None, 3.0])
def test_scores_that_are_not_numbers_score_zero(value: Any) -> None:
    profile = Profile("p", Best(), scorers=(WeightedScorer(Returns("odd", value), 5.0), WeightedScorer(Fixed("fixed", E2), 1.0)))
    run, metrics = scheduler(profile)
    assert run.schedule(REQUEST, PODS) == [E2]
    assert errors(metrics, "Scorer", "odd") + errors(metrics, "Scorer", "odd", "malformed") == 1


def test_nan_and_out_of_range_scores_are_clamped_and_counted_malformed() -> None:
    profile = Profile("p", Best(), scorers=(WeightedScorer(Returns("nan", [math.nan, 2.0, -1.0]), 1.0),))
    run, metrics = scheduler(profile)
    assert run.schedule(REQUEST, PODS) == [E2]  # NaN counts 0, 2.0 counts 1, -1.0 counts 0
    assert errors(metrics, "Scorer", "nan", "malformed") == 1


def test_a_raising_filter_passes_its_input_through() -> None:
    run, metrics = scheduler(Profile("p", Best(), filters=(Raises(),), scorers=(WeightedScorer(Fixed("f", E1), 1.0),)))
    assert run.schedule(REQUEST, PODS) == [E1]
    assert errors(metrics, "Filter", "raises") == 1


def test_a_filter_returning_no_list_passes_its_input_through() -> None:
    run, metrics = scheduler(Profile("p", Best(), filters=(Returns("odd", 42),)))
    assert len(run.schedule(REQUEST, PODS)) == 1
    assert errors(metrics, "Filter", "odd") == 1


@pytest.mark.parametrize("picker", [Raises(), Returns("odd", "not a list")])
def test_a_failing_picker_is_replaced_by_the_best_score(picker: Any) -> None:
    run, metrics = scheduler(Profile("p", picker, scorers=(WeightedScorer(Fixed("f", E2), 1.0),)))
    assert run.schedule(REQUEST, PODS) == [E2]
    assert errors(metrics, "Picker", picker.name) == 1


def test_a_raising_producer_stores_nothing_and_the_next_still_runs() -> None:
    recorder = Recorder()
    run, metrics = scheduler(Profile("p", Best()), producers=(Raises(), recorder))
    assert len(run.schedule(REQUEST, PODS)) == 1
    assert recorder.events == ["produce"]
    assert errors(metrics, "DataProducer", "raises") == 1


def test_a_raising_hook_never_stops_the_hooks_after_it() -> None:
    recorder = Recorder()
    run, metrics = scheduler(Profile("p", Best()), hooks=(Raises(), recorder))
    result = run.run(REQUEST, PODS)
    run.pre_request(REQUEST, result)
    assert run.response_received(REQUEST, E1, {":status": "200"}) == {"x-ok": "1"}
    run.response_complete(REQUEST, E1, "complete")
    assert recorder.events == ["pre", "headers", "complete:complete"]
    for point in ("PreRequest", "ResponseReceived", "ResponseComplete"):
        assert errors(metrics, point, "raises") == 1


def test_a_failing_profile_handler_falls_back_to_the_first_profile() -> None:
    class Broken:
        name = "broken-handler"

        def pick_profiles(self, request: Any, profiles: Any, results: Any) -> Any:
            raise RuntimeError("handler bug")

        def process_results(self, request: Any, results: Any) -> str:
            return "x"

    first = Profile("first", Best(), scorers=(WeightedScorer(Fixed("f", E3), 1.0),))
    second = Profile("second", Best(), scorers=(WeightedScorer(Fixed("g", E1), 1.0),))
    metrics = PluginCallMetrics()
    run = Scheduler((first, second), handler=Broken(), instrument=metrics.instrument({"broken-handler": "broken-handler"}))
    result = run.run(REQUEST, PODS)
    assert (result.primary_profile, result.endpoints) == ("first", [E3])
    assert errors(metrics, "ProfileHandler", "broken-handler") == 1


def test_failures_are_logged_once_a_minute_per_plugin(caplog: pytest.LogCaptureFixture) -> None:
    run, metrics = scheduler(Profile("p", Best(), scorers=(WeightedScorer(Raises(), 1.0),)))
    with caplog.at_level(logging.ERROR):
        for _ in range(50):
            run.schedule(REQUEST, PODS)
    assert errors(metrics, "Scorer", "raises") == 50  # every failure counted...
    assert caplog.text.count("Scorer plugin 'raises' failed") == 1  # ...one logged


def test_a_handler_declaring_single_profile_is_skipped() -> None:
    class Handler:
        name = "h"
        single_profile = True

        def pick_profiles(self, *args: Any) -> Any:
            raise AssertionError("the runner must not call a single_profile handler")

        def process_results(self, *args: Any) -> str:
            raise AssertionError("the runner must not call a single_profile handler")

    run = Scheduler(Profile("p", Best(), scorers=(WeightedScorer(Fixed("f", E2), 1.0),)), handler=Handler())
    assert run.schedule(REQUEST, PODS) == [E2]


def test_several_profiles_need_a_handler() -> None:
    with pytest.raises(ValueError, match="need a profile handler"):
        Scheduler((Profile("a", Best()), Profile("b", Best())))
