"""The discovery flags of ``epp serve`` and the upstream chart's argument lists."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epp.server.cli import main, settings_from_args
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
    assert {"pool-group", "ha-enable-leader-election"} <= set(not_yet)
    assert "pool-name" not in not_yet and "pool-namespace" not in not_yet
    # implemented since issue 16 (item 8): taken, not listed as having no effect
    assert settings.metrics_endpoint_auth is False and "metrics-endpoint-auth" not in not_yet
    assert settings.tracing is False and "tracing" not in not_yet  # implemented since issue 16 (item 6)


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


# -- the commands and their usage errors (issue 16, item 3) ------------------------------------------------------

_GOOD_CONFIG = (
    "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
    "plugins:\n- type: queue-scorer\n- type: max-score-picker\n"
    "schedulingProfiles:\n- name: default\n  plugins: [{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]\n"
)


@pytest.mark.parametrize("argv", [["--version"], ["version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    assert main(argv) == 0
    assert capsys.readouterr().out == f"epp {version('epp')}\n"


def test_an_unknown_command_is_named_with_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serv"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "epp: unknown command 'serv'; did you mean 'serve'?\nRun 'epp -h' for the list of commands.\n"
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("epp: unknown command 'frobnicate'\n")


@pytest.mark.parametrize(
    ("argv", "lines"),
    [
        (["--grpc-prot", "9002"], ["flag provided but not defined: -grpc-prot", "did you mean --grpc-port?"]),
        (["--metric-port=1"], ["flag provided but not defined: -metric-port", "did you mean --metrics-port?"]),
        (
            ["--secure-serving", "false"],
            ["unexpected argument(s): false", "write --secure-serving=false"],
        ),
        (
            ["--endpoints", "http://127.0.0.1:8000"],
            ["--endpoints: 'http://127.0.0.1:8000' is a URL, not an endpoint", "e.g. 127.0.0.1:8000"],
        ),
        (["serve-me"], ["unexpected argument(s): serve-me"]),
    ],
)
def test_flag_errors_say_what_and_how_in_three_lines_at_most(
    argv: list[str], lines: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    got = err.splitlines()
    assert len(got) == len(lines) + 1 <= 3
    for line, expected in zip(got, lines, strict=False):
        assert expected in line
    assert got[-1] == "Run 'epp serve -h' for the list of flags."


def test_a_boolean_given_true_with_equals_is_no_error() -> None:
    settings, _ = settings_from_args(["--secure-serving=false", "--endpoints", "10.0.0.1:8000"])
    assert not settings.secure_serving


def test_endpoints_file_labels_are_space_separated(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.1:8000 zone=a tier=y  # two labels\n")
    settings, _ = settings_from_args(["--endpoints-file", str(path)])
    assert dict(settings.endpoints[0].labels) == {"zone": "a", "tier": "y"}


def test_endpoints_file_labels_joined_by_a_comma_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.1:8000 zone=a,tier=y\n")
    with pytest.raises(FlagError) as info:
        settings_from_args(["--endpoints-file", str(path)])
    assert "label zone='a,tier=y' is not one key=value label" in str(info.value)
    assert "separate labels with spaces: zone=a tier=y" in info.value.hint


def test_a_url_in_the_endpoints_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("# pool\nhttp://10.0.0.1:8000/v1\n")
    with pytest.raises(FlagError) as info:
        settings_from_args(["--endpoints-file", str(path)])
    assert "is a URL, not an endpoint" in str(info.value) and "10.0.0.1:8000" in info.value.hint


def _epp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epp", *args], capture_output=True, text=True, timeout=60)


def test_validate_config_accepts_a_good_file_without_binding_a_port(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(_GOOD_CONFIG)
    with socket.socket() as taken:  # the port serve would bind: validate-config must not need it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _epp("validate-config", "--config-file", str(good), "--grpc-port", str(port))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the configuration is valid: 2 plugin(s), scheduling profile(s) default\n"
    assert "serving ext_proc" not in result.stderr


def test_validate_config_refuses_a_bad_file_as_startup_does(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(_GOOD_CONFIG.replace("- type: queue-scorer", "- type: queue-scorr"))
    checked = _epp("validate-config", "--config-file", str(bad))
    assert checked.returncode == 2 and checked.stdout == ""
    message = "invalid configuration: plugins[0] (queue-scorr): unknown plugin type 'queue-scorr'"
    assert message in checked.stderr
    # `epp serve` stops on the same file with the same message and exit status.
    served = _epp("serve", "--config-file", str(bad), "--metrics-port", "-1", "--grpc-port", "0", "--grpc-health-port", "0")
    assert served.returncode == 2 and message in served.stderr
    # TLS is the default: start-up says which Envoy configuration pairs with it (issue 16, item 4).
    assert "Envoy must use TLS to the picker (deploy/envoy/envoy-tls.yaml" in served.stderr
    assert "Traceback" not in checked.stderr + served.stderr


def test_validate_config_flag_errors_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate-config", "--config-fil", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epp validate-config: flag provided but not defined: -config-fil\n  did you mean --config-file?")
