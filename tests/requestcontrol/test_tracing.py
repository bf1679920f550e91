"""epp.requestcontrol.tracing: off creates nothing; the OTEL_* environment as upstream reads it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epp.requestcontrol.tracing import DEFAULT_SERVICE_NAME, Tracing


def test_with_tracing_off_no_tracer_is_made_and_opentelemetry_is_not_loaded() -> None:
    # A fresh interpreter: other tests in this process load the SDK.
    code = (
        "import sys\n"
        "from epp.server.settings import Settings\n"
        "from epp.server.cli import settings_from_args\n"
        "from epp.server.server import _tracing\n"
        "settings, _ = settings_from_args(['--endpoints', '127.0.0.1:8000'])\n"
        "assert settings.tracing is False\n"
        "assert _tracing(settings) is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.trace')))\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


async def test_the_picker_with_tracing_off_has_no_tracer() -> None:
    from epp.datalayer.static import parse_endpoints
    from epp.server.server import EndpointPicker
    from epp.server.settings import Settings

    picker = EndpointPicker(Settings(endpoints=tuple(parse_endpoints("127.0.0.1:8000")), scrape_metrics=False))
    assert picker.tracing is None and picker.director.tracing is None


def test_defaults_are_upstreams() -> None:
    tracing = Tracing({"OTEL_TRACES_EXPORTER": "none"})
    try:
        assert tracing.service_name == DEFAULT_SERVICE_NAME
        # Upstream's sampler when OTEL_TRACES_SAMPLER is unset: parent-based, 10% of new traces.
        description = tracing.provider.sampler.get_description()
        assert "ParentBased" in description and "TraceIdRatioBased{0.1}" in description
    finally:
        tracing.shutdown()


def test_a_client_traceparent_is_continued_and_an_unsampled_request_records_nothing() -> None:
    tracing = Tracing({"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "always_off"})
    try:
        trace = tracing.start({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"})
        assert not trace.recording
        _version, trace_id, span_id, flags = trace.headers["traceparent"].split("-")
        assert trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and flags == "00"
        assert span_id != "00f067aa0ba902b7"  # the picker's own span, child of the client's
        trace.end("complete", None)
    finally:
        tracing.shutdown()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER='sometimes'"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG='half'"),
        ({"OTEL_TRACES_SAMPLER_ARG": "2"}, "not a number in [0, 1]"),
        ({"OTEL_TRACES_EXPORTER": "jaeger"}, "otlp, console or none"),
    ],
)
def test_a_bad_environment_is_a_clear_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Tracing({"OTEL_TRACES_EXPORTER": "none", **environ})


def test_an_exporter_that_cannot_load_is_a_clear_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # What xds-protos' old copy of opentelemetry/proto does to the OTLP exporter's import.
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    with pytest.raises(ValueError, match="--force-reinstall opentelemetry-proto"):
        Tracing({"OTEL_TRACES_EXPORTER": "otlp"})
