"""deploy/monitoring/: the Grafana dashboard and the alert rules read only metrics the picker exports.

The exported names come from a running picker's own registry (static endpoints, the default
scheduling config, so the prefix-cache plugin's families exist too): every family its collectors
yield, under the sample names Prometheus stores (a counter's ``_total``, a histogram's
``_bucket``/``_sum``/``_count``). Families with labels are yielded before any traffic has created
a series (flow control, scrape errors, plugin errors), so no request has to be sent; their label
names are read from the collectors. One endpoint gets fresh metrics, so the per-pod gauges show theirs.

The metric names in an expression come from :func:`metric_names`, a small PromQL tokenizer: an
identifier is a metric name unless it is followed by ``(`` (a function or aggregation), is a
keyword or an aggregation operator (``sum by (le) (...)``), sits inside ``{...}`` (label
matchers) or ``[...]`` (a range), or is in the label list of ``by``/``without``/``on``/
``ignoring``/``group_left``/``group_right``. Strings, numbers, durations and Grafana's
``$variables`` are skipped. The same pass (:func:`parse`) notes the label names each selector's
matchers use and the grouping labels: a matcher must name a label of its metric (or ``job``/
``instance``), and a grouping label must belong to some metric of the expression, so that a
misspelled label, which Prometheus answers with an empty result rather than an error, fails too.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from epp.datalayer.static import parse_endpoints
from epp.framework import Metrics
from epp.server.server import EndpointPicker
from tests.pickers import loopback_settings

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = MONITORING / "alerts.yaml"

PROMETHEUS_OWN = frozenset({"up"})
"""Series Prometheus itself writes for each target: allowed although the picker does not export them."""

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"inf", "nan", "start", "end"}  # number literals, and @ start() / @ end() (followed by "(" anyway)
    # Aggregation operators: "sum by (le) (x)" puts the by clause between the operator and its "(".
    | {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
    | {"quantile", "limitk", "limit_ratio"}
)
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_MATCHERS = frozenset({"=", "!=", "=~", "!~"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$\w+)
    | (?P<number>0x[0-9a-fA-F]+|(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?(?:ms|[smhdwy])*)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<punct>[(){}\[\],]|[-+*/%^=!<>~@]+)
    """,
    re.VERBOSE,
)


def _tokens(expr: str) -> Iterator[tuple[str, str]]:
    position = 0
    while position < len(expr):
        match = _TOKEN.match(expr, position)
        if match is None:
            raise ValueError(f"cannot tokenize {expr[position : position + 20]!r} in {expr!r}")
        position = match.end()
        kind = match.lastgroup
        assert kind is not None
        if kind != "space":
            yield kind, match.group()


@dataclass
class Parsed:
    """What an expression reads: each metric with the labels its matchers name, and the grouping labels."""

    selectors: dict[str, set[str]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)


def parse(expr: str) -> Parsed:
    """The metric names and label names of a PromQL expression (see the module docstring)."""
    tokens = list(_tokens(expr))
    parsed = Parsed()
    braces = brackets = 0
    label_list = False  # inside the (...) after by/without/on/...
    selector = ""  # the metric whose {...} is open ("" for none)
    for index, (kind, text) in enumerate(tokens):
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if text == "{":
            braces += 1
            previous = tokens[index - 1][1] if index else ""
            selector = previous if previous in parsed.selectors else ""
        elif text == "}":
            braces -= 1
        elif text == "[":
            brackets += 1
        elif text == "]":
            brackets -= 1
        elif text == ")" and label_list:
            label_list = False
        elif kind != "ident":
            continue
        elif braces:
            if following in _MATCHERS and selector:
                parsed.selectors[selector].add(text)
        elif label_list:
            parsed.grouping.add(text)
        elif text in _LABEL_LIST_KEYWORDS and following == "(":
            label_list = True
        elif not (brackets or following == "(" or text.lower() in _KEYWORDS):
            parsed.selectors.setdefault(text, set())
    if braces or brackets:
        raise ValueError(f"unbalanced braces or brackets in {expr!r}")
    return parsed


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    return set(parse(expr).selectors)


def _sample_names(family: Any) -> set[str]:
    """The series names Prometheus stores for one prometheus_client family."""
    name, kind = family.name, family.type
    if kind == "counter":
        return {f"{name}_total"}
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "summary":
        return {name, f"{name}_sum", f"{name}_count"}
    if kind == "info":
        return {f"{name}_info"}
    return {name}


async def _exported() -> dict[str, frozenset[str]]:
    settings = loopback_settings(
        endpoints=tuple(parse_endpoints("127.0.0.1:1,127.0.0.1:2")),
        metrics_port=0,
        scrape_metrics=False,
    )
    picker = EndpointPicker(settings)
    await picker.start()
    try:
        # The per-pod gauges list only endpoints with fresh metrics: give one some.
        assert picker.datastore.update_metrics("127.0.0.1:1", Metrics(waiting_queue_size=1, stale=False))
        registry = picker.metrics.registry
        labels: dict[str, set[str]] = {}
        for family in registry.collect():
            for name in _sample_names(family):
                labels.setdefault(name, set())
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
        # A labelled family with no series yet (no traffic) shows no labels in collect(); its label
        # names are on the collector. prometheus_client has no public accessor for either mapping.
        for collector, names in list(registry._collector_to_names.items()):
            for name in names:
                if name in labels:
                    labels[name].update(getattr(collector, "_labelnames", ()))
                    if name.endswith("_bucket"):
                        labels[name].add("le")
        return {name: frozenset(found) for name, found in labels.items()}
    finally:
        await picker.stop(grace=0)


@pytest.fixture(scope="module")
def exported() -> Mapping[str, frozenset[str]]:
    """Every series name the picker exports -> its label names."""
    return asyncio.run(_exported())


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that draws something (rows are containers, possibly holding collapsed panels)."""
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every expression in both files, variable queries included."""
    found = []
    dashboard = _dashboard()
    for panel in _panels(dashboard):
        for target in panel["targets"]:
            found.append((f"dashboard panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(selector, label) is Grafana's, not PromQL: checked as the grouping it is.
            query = variable["query"]["query"]
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", query)
            assert match, f"variable {variable['name']}: unexpected query {query!r}"
            found.append(
                (f"dashboard variable {variable['name']!r}", f"group by ({match.group(2)}) ({match.group(1)})")
            )
    for rule in _rules():
        found.append((f"alert {rule['alert']}", rule["expr"]))
    return found


_TARGET_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus attaches to every series it scrapes."""


def _unknown(expr: str, exported: Mapping[str, frozenset[str]]) -> set[str]:
    return metric_names(expr) - exported.keys() - PROMETHEUS_OWN


def _unknown_labels(expr: str, exported: Mapping[str, frozenset[str]]) -> set[str]:
    """Labels a matcher gives a metric that has no such label, and grouping labels no metric of ``expr`` has."""
    parsed = parse(expr)
    wrong: set[str] = set()
    known_anywhere = set(_TARGET_LABELS)
    for metric, matched in parsed.selectors.items():
        known = exported.get(metric, frozenset()) | _TARGET_LABELS
        known_anywhere |= known
        wrong |= {f"{metric}{{{label}}}" for label in matched - known}
    return wrong | {f"by ({label})" for label in parsed.grouping - known_anywhere}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('sum by (le, model_name) (rate(a_bucket{job=~"$job", name!="x"}[$__rate_interval]))', {"a_bucket"}),
        ("histogram_quantile(0.99, sum without (pod) (rate(b_bucket[5m] offset 1h)))", {"b_bucket"}),
        ("a / on (instance) group_left (version) b > bool 0.5", {"a", "b"}),
        ("c == 0 or absent(c{job='epp'}) and d unless e", {"c", "d", "e"}),
        ("sum(f) by (le) * 1e3 + -Inf", {"f"}),
        ("max_over_time(g[1h:5m]) @ end()", {"g"}),
    ],
)
def test_the_tokenizer_finds_metric_names_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_the_exported_names_include_the_families_only_traffic_fills(exported: Mapping[str, frozenset[str]]) -> None:
    # The check is worth only what this set holds: families created at start-up but empty until
    # traffic (or flow control, or scraping) must be in it, under their stored sample names.
    for name in (
        "epp_requests_total",
        "inference_extension_flow_control_queue_size",
        "llm_d_epp_flow_control_requests_total",
        "inference_extension_flow_control_request_queue_duration_seconds_bucket",
        "inference_extension_prefix_indexer_hit_ratio_count",
        "epp_plugin_errors_total",
        "epp_endpoint_scrape_errors_total",
        "inference_pool_per_pod_queue_size",
        "process_cpu_seconds_total",
    ):
        assert name in exported
    assert "epp_requests" not in exported and "inference_extension_scheduler_e2e_duration_seconds" not in exported


def test_a_misspelled_metric_is_caught(exported: Mapping[str, frozenset[str]]) -> None:
    assert _unknown('sum(rate(epp_request_total{job="epp"}[5m]))', exported) == {"epp_request_total"}
    # A histogram is stored only as its _bucket/_sum/_count series.
    assert _unknown("rate(inference_objective_request_sizes[5m])", exported) == {"inference_objective_request_sizes"}


def test_a_misspelled_label_is_caught(exported: Mapping[str, frozenset[str]]) -> None:
    expr = 'sum by (reasons) (rate(epp_endpoint_scrape_errors_total{job="epp", endpont="x"}[5m]))'
    assert _unknown_labels(expr, exported) == {"epp_endpoint_scrape_errors_total{endpont}", "by (reasons)"}
    assert _unknown_labels('sum by (le, name) (inference_pool_per_pod_queue_size{model_server_pod="p"})', exported) == {
        "by (le)"
    }
    queue = "inference_extension_flow_control_request_queue_duration_seconds_bucket"
    ok = f'histogram_quantile(0.9, sum by (le, priority) (rate({queue}{{inference_pool="p"}}[5m])))'
    assert _unknown_labels(ok, exported) == set()


def test_every_expression_names_only_exported_metrics(exported: Mapping[str, frozenset[str]]) -> None:
    expressions = _expressions()
    assert len(expressions) > 30
    unknown = {where: sorted(_unknown(expr, exported)) for where, expr in expressions if _unknown(expr, exported)}
    assert unknown == {}
    wrong_labels = {where: sorted(_unknown_labels(expr, exported)) for where, expr in expressions}
    assert {where: labels for where, labels in wrong_labels.items() if labels} == {}
    # Every expression selects something (a target with only literals would be a mistake too).
    assert all(metric_names(expr) for _, expr in expressions)


def test_every_legend_names_labels_its_series_have(exported: Mapping[str, frozenset[str]]) -> None:
    wrong = {}
    for panel in _panels(_dashboard()):
        for target in panel["targets"]:
            parsed = parse(target["expr"])
            labels = set(_TARGET_LABELS).union(*(exported[m] for m in parsed.selectors))
            if parsed.grouping:  # an aggregation keeps only its grouping labels
                labels &= parsed.grouping
            legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            if legend - labels:
                wrong[f"{panel['title']} {target['refId']}"] = sorted(legend - labels)
    assert wrong == {}


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "inference_pool_ready_pods" in variables["pool"]["query"]["query"]
    assert variables["pool"]["query"]["query"].endswith(", name)")
    panels = list(_panels(dashboard))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        title = panel.get("title")
        assert title and panel["type"] in {"timeseries", "stat", "table", "gauge", "bargauge"}, panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], title
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], title
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, title
    # Grafana places panels by gridPos: no two may overlap.
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_pool_panels_filter_by_the_pool_variable() -> None:
    for panel in _panels(_dashboard()):
        for target in panel["targets"]:
            expr = target["expr"]
            if "inference_pool_" in expr:
                assert 'name=~"$pool"' in expr, panel["title"]
            if "flow_control" in expr:
                assert 'inference_pool=~"$pool"' in expr, panel["title"]


def test_every_alert_has_an_expression_a_duration_and_a_severity() -> None:
    rules = _rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)) >= 8
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule["alert"]
        assert rule["expr"].strip(), rule["alert"]
        assert re.fullmatch(r"(\d+[smhdwy])+", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    # The alerts the deployment relies on are there, each on the series that says so.
    by_name = {rule["alert"]: rule["expr"] for rule in rules}
    assert "up" in metric_names(by_name["EppPickerDown"]) and "absent(" in by_name["EppPickerDown"]
    assert "epp_endpoint_metrics_stale" in metric_names(by_name["EppAllEndpointsStale"])
    assert "inference_extension_flow_control_pool_saturation" in metric_names(by_name["EppPoolSaturated"])
    assert "epp_endpoint_scrape_errors_total" in metric_names(by_name["EppScrapeErrors"])
