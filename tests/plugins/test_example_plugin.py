"""The out-of-tree example plugin package (examples/epp-example-plugins), installed as a third party
would install it, loading through entry points and a real config; and the guide that shows it."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint, Handle, InferenceRequest
from epp.scheduling.config import ConfigError, load_config
from epp.scheduling.registry import default_registry

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "examples" / "epp-example-plugins"
ZONE = "topology.kubernetes.io/zone"

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- name: same-zone
  type: example-locality-scorer
  parameters:
    value: us-east-1a
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: same-zone
    weight: 1
"""


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    try:
        metadata.distribution("epp-example-plugins")
    except metadata.PackageNotFoundError:
        pytest.fail(f"install the example plugin package first: pip install -e {PACKAGE.relative_to(ROOT)} (the README's test command does)")


def test_the_example_type_comes_from_its_own_distribution() -> None:
    registry = default_registry()
    assert registry.source("example-locality-scorer") == "epp-example-plugins 0.1.0"


def test_a_real_config_routes_by_the_example_scorer() -> None:
    pods = [Endpoint(f"pod-{i}", f"10.0.0.{i}", 8000, labels={ZONE: zone}) for i, zone in enumerate(["us-east-1b", "us-east-1a", "us-east-1c"])]
    built = load_config(CONFIG, default_registry(), Handle(Datastore(pods)))
    assert built.plugins["same-zone"][0] == "example-locality-scorer"
    request = InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers={})
    for _ in range(5):  # equal queues: the zone decides
        assert built.scheduler.schedule(request, pods)[0].name == "pod-1"


def test_the_example_refuses_a_config_without_its_required_parameter() -> None:
    with pytest.raises(ConfigError, match=r"same-zone: value is required"):
        load_config(CONFIG.replace("    value: us-east-1a\n", ""), default_registry(), Handle(Datastore()))


def test_the_guide_shows_the_example_verbatim() -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text()
    code = (PACKAGE / "epp_example_plugins" / "__init__.py").read_text()
    assert f"```python\n{code}```" in guide
