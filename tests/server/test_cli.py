"""The discovery flags of ``epp serve`` and the upstream chart's argument lists."""

from __future__ import annotations

from pathlib import Path

import pytest

from epp.server.cli import settings_from_args
from epp.server.flags import FlagError


def test_pool_name_turns_discovery_on_in_the_namespace_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NAMESPACE", "llm")
    settings, _ = settings_from_args(["--pool-name", "pool", "--kubeconfig", "/etc/kube/config"])
    assert settings.kube_discovery and settings.pool_name == "pool"
    assert settings.pool_namespace == "llm" and settings.kubeconfig == "/etc/kube/config"
    monkeypatch.delenv("NAMESPACE")
    settings, _ = settings_from_args(["--pool-name", "pool"])
    assert settings.pool_namespace == "default"
    settings, _ = settings_from_args(["--pool-name", "pool", "--pool-namespace", "ns"])
    assert settings.pool_namespace == "ns"


def test_a_static_pool_turns_discovery_off() -> None:
    settings, _ = settings_from_args(["--pool-name", "pool", "--endpoints", "10.0.0.1:8000"])
    assert not settings.kube_discovery and settings.pool_name == "pool"  # the name still labels metrics


def test_endpoint_selector_mode() -> None:
    settings, _ = settings_from_args(["--endpoint-selector", "app=vllm,env=prod", "--endpoint-target-ports", "8000,8001"])
    assert settings.kube_discovery and not settings.pool_name
    assert settings.endpoint_selector == (("app", "vllm"), ("env", "prod"))
    assert settings.endpoint_target_ports == (8000, 8001)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pool-name", "p", "--endpoint-selector", "app=x", "--endpoint-target-ports", "80"], "not both"),
        (["--endpoint-selector", "app=x"], "needs --endpoint-target-ports"),
        (["--endpoint-target-ports", "80"], "needs --endpoint-selector"),
        (["--endpoint-selector", "app=x", "--endpoint-target-ports", "80", "--endpoints", "10.0.0.1:80"], "not both"),
        (["--endpoint-selector", "app", "--endpoint-target-ports", "80"], "not key=value"),
        (["--endpoint-selector", "app=x", "--endpoint-target-ports", "http"], "not a port number"),
        (["--pool-name", "p", "--pool-group", "inference.networking.x-k8s.io"], "only inference.networking.k8s.io"),
    ],
)
def test_discovery_flag_errors(args: list[str], message: str) -> None:
    with pytest.raises(FlagError) as info:
        settings_from_args(args)
    assert message in str(info.value)


def _config(tmp_path: Path) -> str:
    path = tmp_path / "plugins.yaml"
    path.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: random-picker\nschedulingProfiles:\n- name: default\n  plugins: [{pluginRef: random-picker}]\n"
    )
    return str(path)


def test_the_upstream_chart_arguments_are_accepted(tmp_path: Path) -> None:
    # What the inferencepool chart renders for its EPP container (InferencePool mode, 2 replicas).
    chart = [
        "--pool-name", "vllm-qwen3-32b",
        "--pool-namespace", "llm",
        "--pool-group", "inference.networking.k8s.io",
        "--zap-encoder", "json",
        "--config-file", _config(tmp_path),
        "--ha-enable-leader-election",
        "--tracing=false",
        "--metrics-endpoint-auth=false",
        "--grpc-health-port", "9003",
        "-v", "1",
    ]  # fmt: skip
    settings, not_yet = settings_from_args(chart)
    assert settings.kube_discovery and settings.pool_namespace == "llm" and settings.pool_name == "vllm-qwen3-32b"
    assert settings.log_format == "json" and settings.grpc_health_port == 9003
    # each accepted-but-unimplemented flag is named (the CLI logs a warning for each)
    assert {"pool-group", "ha-enable-leader-election", "tracing", "metrics-endpoint-auth"} <= set(not_yet)
    assert "pool-name" not in not_yet and "pool-namespace" not in not_yet


def test_the_upstream_chart_no_crd_arguments_are_accepted(tmp_path: Path) -> None:
    # The same chart with endpointsServer (no InferencePool).
    settings, _ = settings_from_args([
        "--endpoint-selector", "app=vllm-qwen3-32b",
        "--endpoint-target-ports", "8000",
        "--zap-encoder", "json",
        "--config-file", _config(tmp_path),
        "--tracing=false",
    ])  # fmt: skip
    assert settings.kube_discovery and settings.endpoint_selector == (("app", "vllm-qwen3-32b"),)
    assert settings.endpoint_target_ports == (8000,)


def test_metric_flags_lose_the_quotes_the_upstream_chart_leaves_in_them() -> None:
    from epp.server.cli import settings_from_args

    settings, _ = settings_from_args(
        ["--endpoints", "10.0.0.1:8000", '--total-queued-requests-metric="sglang:num_queue_reqs"', "--kv-cache-usage-percentage-metric='x:y'"]
    )
    assert dict(settings.metric_overrides) == {"total-queued-requests-metric": "sglang:num_queue_reqs", "kv-cache-usage-percentage-metric": "x:y"}


def test_older_charts_log_level_flag_is_accepted_and_named_as_without_effect() -> None:
    from epp.server.cli import settings_from_args

    _, not_yet = settings_from_args(["--endpoints", "10.0.0.1:8000", "--log-level", "error"])
    assert "log-level" in not_yet
