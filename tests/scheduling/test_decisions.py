"""Decision records: one JSON line per request at -v 4, none by default."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint, Handle, InferenceRequest, Metrics
from epp.scheduling.config import load_config
from epp.scheduling.registry import default_registry
from epp.server.logs import configure_logging

PODS = [Endpoint(f"pod-{i}", f"10.0.0.{i}", 8000, metrics=Metrics(waiting_queue_size=i, stale=False)) for i in range(3)]
PROMPT = "a system prompt long enough to span several blocks of the prefix index " * 8


def _request(i: int) -> InferenceRequest:
    return InferenceRequest(request_id=f"r{i}", method="POST", path="/v1/completions", model="m", prompt=PROMPT)


def _records(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records if r.name == "epp.decisions"]


def test_a_record_names_candidates_scores_pick_and_the_prefix_match(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = load_config(None, default_registry(), Handle(Datastore(PODS))).scheduler
    earlier = _request(0)
    first = scheduler.run(earlier, PODS)
    scheduler.pre_request(earlier, first)  # the prompt is now recorded on the picked pod
    with caplog.at_level(logging.INFO, logger="epp.decisions"):
        result = scheduler.run(_request(1), PODS)
    (record,) = _records(caplog)
    assert record["request_id"] == "r1" and record["model"] == "m" and record["primary_profile"] == "default"
    (profile,) = record["profiles"]
    assert profile["candidates"] == 3 and profile["picked"] == [e.name for e in result.endpoints]
    assert profile["weights"] == {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0}
    best = profile["top"][0]
    assert best["endpoint"] == result.endpoints[0].name == first.endpoints[0].name
    assert best["scores"]["prefix-cache-scorer"] == 1.0 and best["total"] == max(t["total"] for t in profile["top"])
    assert record["prefix_match_tokens"][best["endpoint"]] == record["prompt_tokens_matched_of"] > 0


def test_filters_are_recorded_with_what_they_kept(caplog: pytest.LogCaptureFixture) -> None:
    text = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: low-queue-filter, parameters: {threshold: 1}}
- type: queue-scorer
schedulingProfiles:
- name: p
  plugins: [{pluginRef: low-queue-filter}, {pluginRef: queue-scorer}]
"""
    scheduler = load_config(text, default_registry(), Handle(Datastore(PODS))).scheduler
    with caplog.at_level(logging.INFO, logger="epp.decisions"):
        scheduler.run(_request(2), PODS)
    (record,) = _records(caplog)
    assert record["profiles"][0]["filters"] == [{"filter": "low-queue-filter", "kept": ["pod-0", "pod-1"]}]


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide loggers: put them back after the test."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name in ("epp", "epp.decisions"):
        logging.getLogger(name).setLevel(logging.NOTSET)


@pytest.mark.parametrize(("verbosity", "recorded"), [(1, False), (3, False), (4, True)])
@pytest.mark.usefixtures("restore_logging")
def test_records_are_on_from_verbosity_4_only(verbosity: int, recorded: bool) -> None:
    configure_logging(verbosity, "console")
    assert logging.getLogger("epp.decisions").isEnabledFor(logging.INFO) is recorded


@pytest.mark.parametrize(
    ("verbosity", "epp_debug", "library_debug"),
    [(2, False, False), (3, True, False), (4, True, False), (5, True, True)],
)
@pytest.mark.usefixtures("restore_logging")
def test_epps_debug_from_verbosity_3_and_the_libraries_only_from_5(
    verbosity: int, epp_debug: bool, library_debug: bool
) -> None:
    """hpack logs each header block it decodes at debug: at -v 3 and 4 it would bury the decision records."""
    configure_logging(verbosity, "console")
    assert logging.getLogger("epp.wire.http2").isEnabledFor(logging.DEBUG) is epp_debug
    assert logging.getLogger("hpack.hpack").isEnabledFor(logging.DEBUG) is library_debug
