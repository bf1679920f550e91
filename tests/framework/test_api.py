"""The plugin API's surface: what epp.framework exports is pinned, and it is all a plugin needs."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import epp.framework

ROOT = Path(__file__).resolve().parents[2]

# Adding a name is fine (add it here); removing or renaming one breaks third-party plugins.
EXPORTED = {
    "DEFAULT_PICKER", "DEFAULT_SATURATION_DETECTOR", "NEVER_SCRAPED", "NOT_LISTED", "NO_IN_FLIGHT", "PREFIX_MATCH", "ROLES",
    "Api", "CountedPicker", "DataProducer", "Duration", "Endpoint", "Filter", "Handle", "InFlightView",
    "InferenceRequest", "LogLimiter", "Metrics", "Outcome", "Picker", "PluginMetrics", "Pool", "PoolListener", "PreRequest",
    "PrefixMatch", "PrepareData", "Profile", "ProfileHandler", "RequestState", "ResponseComplete", "ResponseReceived",
    "ScoredCandidates", "ScoredEndpoint", "SchedulingResult", "Scorer", "ServedModels", "StateKey", "WeightedScorer",
    "bool_parameter", "check_parameters", "declared_keys", "default_producer_of", "duration_parameter",
    "endpoint_in_flight", "float_parameter", "format_duration", "int_parameter", "lower_is_better",
    "max_num_of_endpoints", "parse_duration", "roles", "str_parameter",
}  # fmt: skip


def test_the_exported_names_are_pinned() -> None:
    assert set(epp.framework.__all__) == EXPORTED
    for name in EXPORTED:
        assert getattr(epp.framework, name) is not None


def test_every_exported_class_and_function_is_documented() -> None:
    for name in EXPORTED:
        value = getattr(epp.framework, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"epp.framework.{name} has no docstring"


def test_importing_the_framework_imports_nothing_else_of_epp() -> None:
    code = "import sys, epp.framework; print(sorted(m for m in sys.modules if m.startswith('epp')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(m == "epp" or m.startswith("epp.framework") for m in eval(loaded)), loaded


def test_built_in_plugins_import_only_the_framework_and_the_prefix_library() -> None:
    # The same rule lint-imports enforces in CI, checked here on the source so a test run shows it too.
    pattern = re.compile(r"^\s*(?:from|import)\s+(epp(?:\.\w+)*)", re.M)
    for path in [*(ROOT / "plugins").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]:
        for module in pattern.findall(path.read_text()):
            assert module.startswith(("epp.framework", "epp.prefix")), f"{path.relative_to(ROOT)} imports {module}"
