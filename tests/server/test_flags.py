"""Go ``flag`` semantics (epp.server.flags) and the ``epp serve`` flag table (epp.server.cli): the upstream
chart's arguments must be accepted unchanged, and every mistake must be named."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from epp.framework import Endpoint
from epp.server.cli import SERVE_FLAGS, main, settings_from_args
from epp.server.flags import Flag, FlagError, FlagSet, make_flag
from epp.server.settings import DEFAULT_MAX_REQUEST_BODY_BYTES, Settings

_FLAGS = FlagSet(
    "test",
    [
        make_flag("port", 9002, "an int"),
        make_flag("secure", True, "a bool defaulting to true"),
        make_flag("debug", False, "a bool defaulting to false"),
        make_flag("name", "", "a string"),
        make_flag("grace", 20.0, "a float"),
    ],
)
_DEFAULTS = {"port": 9002, "secure": True, "debug": False, "name": "", "grace": 20.0}


# -- epp.server.flags.FlagSet ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "changed", "positional", "given"),
    [
        ([], {}, [], set()),
        (["-port", "1"], {"port": 1}, [], {"port"}),
        (["--port", "1"], {"port": 1}, [], {"port"}),
        (["-port=1"], {"port": 1}, [], {"port"}),
        (["--port=1"], {"port": 1}, [], {"port"}),
        (["-port=0x10"], {"port": 16}, [], {"port"}),  # Go's base-0 ParseInt
        (["-port=-5"], {"port": -5}, [], {"port"}),
        (["-name", "-port"], {"name": "-port"}, [], {"name"}),  # a value may look like a flag
        (["-name="], {"name": ""}, [], {"name"}),
        (["-name=a=b"], {"name": "a=b"}, [], {"name"}),  # only the first = splits
        (["-grace", "2.5"], {"grace": 2.5}, [], {"grace"}),
        # a bare bool flag is true; its value comes only after =
        (["-debug"], {"debug": True}, [], {"debug"}),
        (["--debug"], {"debug": True}, [], {"debug"}),
        (["-secure=false"], {"secure": False}, [], {"secure"}),
        (["-secure", "false"], {"secure": True}, ["false"], {"secure"}),
        # the last occurrence wins
        (["-port", "1", "-port", "2"], {"port": 2}, [], {"port"}),
        # parsing stops at --, at the first non-flag and at a lone "-"
        (["-port", "1", "--", "-debug"], {"port": 1}, ["-debug"], {"port"}),
        (["--"], {}, [], set()),
        (["-port", "1", "serve", "-debug"], {"port": 1}, ["serve", "-debug"], {"port"}),
        (["-", "-debug"], {}, ["-", "-debug"], set()),
        (["x"], {}, ["x"], set()),
    ],
)
def test_parse(argv: list[str], changed: dict[str, Any], positional: list[str], given: set[str]) -> None:
    values, rest, given_names = _FLAGS.parse(argv)
    assert values == {**_DEFAULTS, **changed}
    assert rest == positional
    assert given_names == given


@pytest.mark.parametrize("text", ["1", "t", "T", "TRUE", "true", "True"])
def test_go_true_spellings(text: str) -> None:
    values, _, _ = _FLAGS.parse([f"-debug={text}"])
    assert values["debug"] is True


@pytest.mark.parametrize("text", ["0", "f", "F", "FALSE", "false", "False"])
def test_go_false_spellings(text: str) -> None:
    values, _, _ = _FLAGS.parse([f"-secure={text}"])
    assert values["secure"] is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # strconv.ParseBool knows exactly twelve spellings
        (["-secure=yes"], 'invalid boolean value "yes" for -secure: parse error'),
        (["-secure=tRuE"], 'invalid boolean value "tRuE" for -secure: parse error'),
        (["-secure="], 'invalid boolean value "" for -secure: parse error'),
        (["-port", "abc"], 'invalid value "abc" for flag -port: parse error'),
        (["-port=1.5"], 'invalid value "1.5" for flag -port: parse error'),
        (["-port="], 'invalid value "" for flag -port: parse error'),
        (["-grace", "soon"], 'invalid value "soon" for flag -grace: parse error'),
        (["-bogus"], "flag provided but not defined: -bogus"),
        (["--bogus=1"], "flag provided but not defined: -bogus"),
        (["-port"], "flag needs an argument: -port"),
        (["--name"], "flag needs an argument: -name"),
        (["---port"], "bad flag syntax: ---port"),
        (["-=1"], "bad flag syntax: -=1"),
        (["-h"], "help requested"),
        (["--help"], "help requested"),
        (["-port", "1", "-h"], "help requested"),
    ],
)
def test_parse_errors(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as info:
        _FLAGS.parse(argv)
    assert str(info.value) == message


# Go's strconv.ParseInt(text, 0, 64): a leading 0 is octal ("010" is 8), whitespace is an error.
@pytest.mark.parametrize(("text", "expected"), [("010", 8), ("0o10", 8), ("0b11", 3), ("1_000", 1000)])
def test_int_flag_follows_go_base_prefixes(text: str, expected: int) -> None:
    values, _, _ = _FLAGS.parse([f"-port={text}"])
    assert values["port"] == expected


@pytest.mark.parametrize("text", [" 1", "1 "])
def test_int_flag_rejects_whitespace_like_go(text: str) -> None:
    # Go answers `invalid value " 1" ...: parse error`.
    with pytest.raises(FlagError, match="parse error"):
        _FLAGS.parse([f"-port={text}"])


def test_make_flag_takes_its_kind_from_the_default() -> None:
    assert make_flag("a", 1, "").kind is int
    assert make_flag("b", True, "").kind is bool
    assert make_flag("c", 1.0, "").kind is float
    assert make_flag("d", "", "").kind is str
    assert make_flag("e", "", "", kind=int).kind is int
    assert make_flag("f", 0, "", implemented=False) == Flag("f", 0, "", kind=int, implemented=False)


def test_usage_lists_every_flag_and_marks_the_unimplemented_ones() -> None:
    usage = SERVE_FLAGS.usage()
    assert usage.startswith("Usage of epp serve:\n")
    for name in SERVE_FLAGS.flags:
        assert f"\n  -{name}" in usage
    assert "  -grpc-port int\n" in usage
    assert "  -secure-serving\n" in usage  # bools show no value type, as in Go
    assert "leader election between replicas (accepted for compatibility; no effect yet)" in usage
    assert "serve ext_proc over TLS (default true)" in usage  # Go's spelling of defaults
    assert 'log format: console or json (default "console")' in usage


# -- the epp serve flag table -------------------------------------------------------------------


def test_defaults_match_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    settings, not_yet = settings_from_args([])
    assert settings == Settings()
    assert (settings.grpc_port, settings.grpc_health_port, settings.metrics_port) == (9002, 9003, 9090)
    assert settings.secure_serving is True
    assert settings.pool_namespace == "default"
    assert settings.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert settings.config_text is None
    assert not_yet == []


def test_upstream_helm_chart_arguments_are_accepted(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n")
    argv = [
        "--pool-name", "vllm-llama3-8b-instruct",
        "--pool-namespace", "default",
        "--pool-group", "inference.networking.k8s.io",
        "--zap-encoder", "json",
        "--config-file", str(config),
        "--grpc-port", "9002",
        "--grpc-health-port", "9003",
        "--metrics-port", "9090",
        "--tracing=false",
        "-v", "1",
        "--ha-enable-leader-election",
    ]  # fmt: skip
    settings, not_yet = settings_from_args(argv)
    assert settings.pool_name == "vllm-llama3-8b-instruct"
    assert settings.pool_namespace == "default"
    assert settings.log_format == "json"
    assert settings.config_text == config.read_text()
    assert (settings.grpc_port, settings.grpc_health_port, settings.metrics_port) == (9002, 9003, 9090)
    assert settings.verbosity == 1
    assert settings.secure_serving is True
    # Given explicitly but without effect yet: reported, even when set to its default value.
    assert not_yet == ["ha-enable-leader-election", "pool-group"]
    # implemented since issue 16 (item 6): taken, not listed as having no effect
    assert settings.tracing is False


@pytest.mark.parametrize(
    ("argv", "field", "expected"),
    [
        (["-secure-serving"], "secure_serving", True),
        (["-secure-serving=false"], "secure_serving", False),
        (["--secure-serving=0"], "secure_serving", False),
        (["-grpc-port=1"], "grpc_port", 1),
        (["-grpc-health-port", "2"], "grpc_health_port", 2),
        (["--metrics-port", "3"], "metrics_port", 3),
        (["-bind-address", "127.0.0.1"], "bind_address", "127.0.0.1"),
        (["-cert-path", "/certs"], "cert_path", "/certs"),
        (["-enable-cert-reload"], "cert_reload", True),
        (["-disable-endpoint-subset-filter"], "subset_filter", False),
        ([], "subset_filter", True),
        (["-io-thread=false"], "io_thread", False),
        (["-config-text", "kind: x"], "config_text", "kind: x"),
        (["-max-request-body-bytes", "1024"], "max_request_body_bytes", 1024),
        (["-shutdown-grace-period", "2.5s"], "shutdown_grace_seconds", 2.5),
        (["-drain-timeout", "30s"], "drain_seconds", 30.0),
        ([], "drain_seconds", 0.0),
        (["-refresh-metrics-interval=100ms"], "refresh_metrics_interval", 0.1),
        (["-refresh-metrics-idle-interval=500ms"], "refresh_metrics_idle_interval", 0.5),
        (["-refresh-metrics-idle-interval=0"], "refresh_metrics_idle_interval", 0.0),
        (["-metrics-staleness-threshold", "1m"], "metrics_staleness_threshold", 60.0),
        (["-scrape-metrics=false"], "scrape_metrics", False),
        (["-model-server-metrics-path", "/m"], "model_server_metrics_path", "/m"),
        (["-total-queued-requests-metric", "q"], "metric_overrides", (("total-queued-requests-metric", "q"),)),
        (["-v", "4"], "verbosity", 4),
        (["-zap-encoder=console"], "log_format", "console"),
        (["-pool-namespace", "prod"], "pool_namespace", "prod"),
        (["-endpoints", "10.0.0.1:8000"], "endpoints", (Endpoint("10.0.0.1:8000", "10.0.0.1", 8000),)),
    ],
)
def test_flag_reaches_settings(argv: list[str], field: str, expected: Any) -> None:
    settings, _ = settings_from_args(argv)
    assert getattr(settings, field) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Go semantics: `-secure-serving false` sets true and leaves "false" as an argument.
        (["-secure-serving", "false"], "unexpected argument(s): false"),
        (["-grpc-port", "1", "extra", "args"], "unexpected argument(s): extra args"),
        (["-secure-serving=no"], 'invalid boolean value "no" for -secure-serving: parse error'),
        (["-grpc-port", "x"], 'invalid value "x" for flag -grpc-port: parse error'),
        (["--bogus"], "flag provided but not defined: -bogus"),
        (["--metrics-port"], "flag needs an argument: -metrics-port"),
        (["-config-file", "a", "-config-text", "b"], "give --config-file or --config-text, not both"),
        (["-zap-encoder", "text"], "--zap-encoder must be console or json, got 'text'"),
        (["-max-request-body-bytes", "0"], "--max-request-body-bytes must be positive"),
        (["-io-thread-after-chunks", "0"], "--io-thread-after-chunks must be at least 1"),
        (
            ["-refresh-metrics-idle-interval=-1s"],
            "--refresh-metrics-idle-interval cannot be negative (0 turns the backoff off)",
        ),
        (["-h"], "help requested"),
    ],
)
def test_settings_errors(argv: list[str], message: str) -> None:
    with pytest.raises(FlagError) as info:
        settings_from_args(argv)
    assert str(info.value) == message


def test_missing_config_file_is_a_flag_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FlagError, match=r"^--config-file: .*No such file"):
        settings_from_args(["--config-file", str(missing)])


@pytest.mark.parametrize(
    ("endpoints", "expected"),
    [
        ("10.0.0.1:8000,10.0.0.2:8001", ["10.0.0.1:8000", "10.0.0.2:8001"]),
        ("10.0.0.1:8000 10.0.0.2:8000", ["10.0.0.1:8000", "10.0.0.2:8000"]),
        (" 10.0.0.1:8000 , [fd00::1]:8000 ,", ["10.0.0.1:8000", "[fd00::1]:8000"]),
        ("", []),
    ],
)
def test_endpoints_flag(endpoints: str, expected: list[str]) -> None:
    settings, _ = settings_from_args(["--endpoints", endpoints])
    assert [e.hostport for e in settings.endpoints] == expected


@pytest.mark.parametrize(
    ("endpoints", "message"),
    [
        ("pod-a:8000", "--endpoints: endpoint 'pod-a:8000': 'pod-a' is not an IP address"),
        ("10.0.0.1", "--endpoints: endpoint '10.0.0.1' is not ip:port"),
        ("10.0.0.1:0", "--endpoints: endpoint '10.0.0.1:0': port must be 1-65535"),
        ("10.0.0.1:8000,10.0.0.1:8000", "--endpoints: endpoint 10.0.0.1:8000 is listed twice"),
    ],
)
def test_endpoints_flag_errors(endpoints: str, message: str) -> None:
    with pytest.raises(FlagError) as info:
        settings_from_args(["--endpoints", endpoints])
    assert str(info.value).startswith(message)


def test_endpoints_file_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("# the pool\n10.0.0.1:8000  # pod a\n\n10.0.0.2:8000\n10.0.0.3:8000\n   # done\n")
    settings, _ = settings_from_args([f"--endpoints-file={path}"])
    assert [e.hostport for e in settings.endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


def test_endpoints_and_endpoints_file_add_up(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.2:8000\n")
    settings, _ = settings_from_args(["--endpoints", "10.0.0.1:8000", "--endpoints-file", str(path)])
    assert [e.hostport for e in settings.endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_endpoint_listed_in_both_endpoints_and_file_is_an_error(tmp_path: Path) -> None:
    # Duplicates across --endpoints and --endpoints-file are caught too.
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.1:8000\n")
    with pytest.raises(FlagError, match=r"10\.0\.0\.1:8000 is listed twice"):
        settings_from_args(["--endpoints", "10.0.0.1:8000", "--endpoints-file", str(path)])


def test_missing_endpoints_file_is_a_flag_error(tmp_path: Path) -> None:
    with pytest.raises(FlagError, match=r"^--endpoints-file: .*No such file"):
        settings_from_args(["--endpoints-file", str(tmp_path / "nope.txt")])


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        (None, [], "default"),
        ("team-a", [], "team-a"),
        ("team-a", ["--pool-namespace", "team-b"], "team-b"),
    ],
)
def test_pool_namespace_defaults_to_namespace_env(
    monkeypatch: pytest.MonkeyPatch, env: str | None, argv: list[str], expected: str
) -> None:
    if env is None:
        monkeypatch.delenv("NAMESPACE", raising=False)
    else:
        monkeypatch.setenv("NAMESPACE", env)
    settings, _ = settings_from_args(argv)
    assert settings.pool_namespace == expected


def test_every_unimplemented_flag_is_reported_when_given() -> None:
    unimplemented = sorted(name for name, flag in SERVE_FLAGS.flags.items() if not flag.implemented)
    argv = []
    for name in unimplemented:
        flag = SERVE_FLAGS.flags[name]
        argv.append(f"--{name}={flag.default}" if flag.kind is not bool else f"--{name}")
    _, not_yet = settings_from_args(argv)
    assert not_yet == unimplemented
    assert {"pool-group", "ha-enable-leader-election"} <= set(not_yet)
    assert "tracing" not in not_yet


# Every flag of upstream's EPP (llm-d's, which GIE's moved to; its options.go of 2026 and controller-runtime's
# zap flags), with a value of the form its chart or an operator writes. KServe passes --enable-cert-reload,
# which stopped this picker at startup ("flag provided but not defined") before it knew the flag.
_UPSTREAM_ARGS = [
    "--grpc-port=9002", "--ha-enable-leader-election=false", "--drain-timeout=30s", "--grpc-max-recv-msg-size=10MiB",
    "--grpc-max-send-msg-size=25MB", "--pool-group=inference.networking.k8s.io", "--pool-namespace=ns",
    "--pool-name=pool", "--disable-endpoint-subset-filter=false", "--emit-endpoint-scores=false",
    "--refresh-metrics-interval=50ms", "--refresh-prometheus-metrics-interval=5s", "--metrics-staleness-threshold=2s",
    "--plugin-state-staleness-threshold=10m", "--v=2", "--zap-encoder=json", "--zap-devel=false",
    "--zap-log-level=info", "--zap-stacktrace-level=error", "--zap-time-encoding=iso8601", "--tracing=false",
    "--health-checking=false", "--metrics-port=9090", "--grpc-health-port=9003", "--enable-pprof=true",
    "--cert-path=/certs", "--enable-cert-reload", "--enable-grpc-stream-metrics=true",
    "--fairness-id-metric-label-limit=1000", "--secure-serving=true", "--tls-min-version=VersionTLS12",
    "--tls-cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "--metrics-endpoint-auth=true",
    "--metrics-client-ca-file=/ca.pem", "--metrics-cert-dir=/metrics-certs", "--config-text=kind: x",
    "--feature-gates=flowControl=true", "--allow-experimental-plugins=false",
]  # fmt: skip


def test_every_upstream_flag_is_accepted(tmp_path: Path) -> None:
    from epp.server.tls import self_signed_certificate

    cert, key = self_signed_certificate()
    (tmp_path / "tls.crt").write_bytes(cert)
    (tmp_path / "tls.key").write_bytes(key)
    files = {"/metrics-certs": str(tmp_path), "/ca.pem": str(tmp_path / "tls.crt")}  # (checked for at startup)
    argv = [arg.split("=")[0] + "=" + files[arg.split("=")[1]] if arg.split("=")[-1] in files else arg for arg in _UPSTREAM_ARGS]
    settings, not_yet = settings_from_args(argv)
    assert settings.cert_reload and settings.subset_filter and settings.cert_path == "/certs"
    assert settings.tls_min_version == "VersionTLS12"
    assert settings.tls_cipher_suites == ("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",)
    assert settings.drain_seconds == 30.0
    implemented = {
        "enable-cert-reload", "disable-endpoint-subset-filter", "tls-min-version", "tls-cipher-suites", "drain-timeout",
        "emit-endpoint-scores", "feature-gates", "metrics-cert-dir", "metrics-client-ca-file", "zap-log-level",
        "grpc-max-recv-msg-size", "enable-grpc-stream-metrics", "zap-devel", "zap-stacktrace-level", "zap-time-encoding",
    }  # fmt: skip
    assert not implemented & set(not_yet)
    assert settings.feature_gates == ("flowControl=true",)
    assert {"grpc-max-send-msg-size"} <= set(not_yet)
    assert (settings.log_format, settings.log_stacks_from, settings.log_time_encoding) == ("json", logging.ERROR, "iso8601")
    assert settings.grpc_max_recv_message == 10 << 20


# -- epp.server.cli.main -------------------------------------------------------------------------------


def test_main_serve_with_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 16: the error, then one line pointing at -h; the usage no longer scrolls it away.
    assert main(["serve", "--bogus"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "epp serve: flag provided but not defined: -bogus\nRun 'epp serve -h' for the list of flags.\n"


def test_main_flags_without_subcommand_go_to_serve(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--grpc-port", "nope"]) == 2
    assert 'invalid value "nope" for flag -grpc-port: parse error' in capsys.readouterr().err


def test_main_serve_help_exits_0_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "-h"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Usage of epp serve:") and err == ""
    assert "help requested" not in out
    assert "--endpoints-file format:" in out  # the label syntax is documented in the help


@pytest.mark.parametrize(("argv", "status"), [([], 2), (["-h"], 0), (["--help"], 0), (["help"], 0)])
def test_main_usage(argv: list[str], status: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == status
    out, err = capsys.readouterr()
    # Help asked for goes to stdout; the usage after a mistake goes to stderr.
    assert (out if status == 0 else err).startswith("usage: epp <command> [flags]")


@pytest.mark.parametrize(
    ("argv", "verbosity", "floor"),
    [
        (["-v", "4"], 4, 0),
        (["-v", "4", "--zap-log-level=info"], 0, 0),  # upstream: the zap level, when given, wins over -v
        (["--zap-log-level", "debug"], 1, 0),
        (["--zap-log-level=5"], 5, 0),
        (["--zap-log-level=error"], 0, logging.ERROR),
        (["--zap-log-level=Panic"], 0, logging.CRITICAL),
    ],
)
def test_zap_log_level(argv: list[str], verbosity: int, floor: int) -> None:
    settings, not_yet = settings_from_args(argv)
    assert (settings.verbosity, settings.log_floor) == (verbosity, floor)
    assert "zap-log-level" not in not_yet


def test_a_bad_zap_log_level_is_named() -> None:
    with pytest.raises(FlagError, match=r"invalid argument 'loud' for --zap-log-level: must be debug, info"):
        settings_from_args(["--zap-log-level=loud"])


def test_a_floor_keeps_everything_below_it_out(caplog: pytest.LogCaptureFixture) -> None:
    from epp.server.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("epp").level, logging.getLogger("epp.decisions").level
    try:
        configure_logging(4, "console", logging.ERROR)
        assert not logging.getLogger("epp").isEnabledFor(logging.WARNING)
        assert not logging.getLogger("epp.decisions").isEnabledFor(logging.INFO)
        assert logging.getLogger("epp.server").isEnabledFor(logging.ERROR)
        configure_logging(4, "console")
        assert logging.getLogger("epp.decisions").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.getLogger("epp").setLevel(saved[2])
        logging.getLogger("epp.decisions").setLevel(saved[3])
