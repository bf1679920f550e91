"""deploy/kubernetes/, validated offline: core kinds against the Kubernetes OpenAPI schemas
(kubernetes-validate, strict: unknown fields are errors), the CRD kinds (InferencePool, HTTPRoute,
Gateway, GatewayClass) structurally, and the invariants the picker's deployment must keep."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from epp.datalayer.engines import ENGINE_TYPE_LABEL
from epp.datalayer.static import parse_endpoints
from epp.kube.pods import PoolSpec, pool_spec
from epp.server.cli import settings_from_args
from epp.server.server import EndpointPicker
from epp.server.settings import Settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("envoy-gateway", "kgateway")
CORE_KINDS = {
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "ClusterRole",
    "ClusterRoleBinding",
    "ConfigMap",
    "Deployment",
    "Service",
}
CRD_KINDS = {"InferencePool", "HTTPRoute", "Gateway", "GatewayClass"}
# The oldest Kubernetes the manifests target (native gRPC probes are GA since 1.27) and the newest.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def _manifest_files(directory: Path = DEPLOY) -> Iterator[Path]:
    """The Kubernetes objects' files (not kustomizations, not Helm values)."""
    for path in sorted(directory.rglob("*.yaml")):
        if path.name != "kustomization.yaml" and not path.name.endswith("-values.yaml"):
            yield path


def _objects(paths: Iterator[Path]) -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in paths for doc in yaml.safe_load_all(path.read_text()) if doc]


ALL = _objects(_manifest_files())
BASE = _objects(_manifest_files(DEPLOY / "base"))


def one(kind: str, name: str | None = None, objects: list[tuple[Path, dict[str, Any]]] = BASE) -> dict[str, Any]:
    found = [doc for _, doc in objects if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def test_every_object_is_a_known_kind() -> None:
    kinds = {doc["kind"] for _, doc in ALL}
    assert kinds <= CORE_KINDS | CRD_KINDS, kinds - CORE_KINDS - CRD_KINDS
    assert kinds >= CORE_KINDS and kinds >= CRD_KINDS


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"),
    [(p, d) for p, d in ALL if d["kind"] in CORE_KINDS],
    ids=lambda v: (
        v.name if isinstance(v, Path) else f"{v['kind']}/{v['metadata']['name']}" if isinstance(v, dict) else str(v)
    ),
)
def test_core_kinds_validate_against_the_kubernetes_schema(path: Path, doc: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


# -- the CRD kinds, structurally ----------------------------------------------------------------------

_NAME_OK = __import__("re").compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _check_metadata(doc: dict[str, Any]) -> None:
    assert set(doc) <= {"apiVersion", "kind", "metadata", "spec"}, set(doc)
    assert _NAME_OK.match(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63


def test_inference_pool_is_a_valid_v1_object() -> None:
    pool = one("InferencePool")
    _check_metadata(pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
    assert {"selector", "targetPorts", "endpointPickerRef"} <= set(spec)
    assert set(spec["selector"]) == {"matchLabels"} and 1 <= len(spec["selector"]["matchLabels"]) <= 64
    assert pool_spec(pool) == PoolSpec(selector=(("app", "vllm-qwen"),), target_ports=(8000,))  # what discovery reads
    ref = spec["endpointPickerRef"]
    assert set(ref) <= {"group", "kind", "name", "port", "failureMode"}
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert set(ref["port"]) == {"number"}  # required when the kind is Service (the CRD's CEL rule)
    assert ref["failureMode"] in ("FailOpen", "FailClose")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_and_route_fit_together(overlay: str) -> None:
    objects = _objects(_manifest_files(DEPLOY / overlay)) + BASE
    gateway = one("Gateway", objects=objects)
    route = one("HTTPRoute", objects=objects)
    for doc in (gateway, route):
        _check_metadata(doc)
        assert doc["apiVersion"] == "gateway.networking.k8s.io/v1"
    (listener,) = gateway["spec"]["listeners"]
    assert listener["protocol"] == "HTTP" and 1 <= listener["port"] <= 65535 and _NAME_OK.match(listener["name"])
    (parent,) = route["spec"]["parentRefs"]
    assert parent == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway["metadata"]["name"]}
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": one("InferencePool")["metadata"]["name"],
    }
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert set(rule["timeouts"]) <= {"request", "backendRequest"}
    if overlay == "envoy-gateway":
        gateway_class = one("GatewayClass", objects=objects)
        _check_metadata(gateway_class)
        assert gateway["spec"]["gatewayClassName"] == gateway_class["metadata"]["name"]
        assert gateway_class["spec"] == {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"}
    else:
        assert gateway["spec"]["gatewayClassName"] == "kgateway"  # the class kgateway's Helm chart creates


def test_gateway_helm_values_turn_inference_pools_on() -> None:
    eg = yaml.safe_load((DEPLOY / "envoy-gateway" / "envoy-gateway-values.yaml").read_text())
    manager = eg["config"]["envoyGateway"]["extensionManager"]
    pools = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "version": "v1"}
    assert pools in manager["backendResources"]
    assert manager["service"]["fqdn"]["hostname"].startswith("ai-gateway-controller.")
    kgw = yaml.safe_load((DEPLOY / "kgateway" / "kgateway-values.yaml").read_text())
    assert kgw == {"inferenceExtension": {"enabled": True}}


@pytest.mark.parametrize("directory", ["base", *OVERLAYS])
def test_kustomizations_list_files_that_exist(directory: str) -> None:
    kustomization = yaml.safe_load((DEPLOY / directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    for resource in kustomization["resources"]:
        assert (DEPLOY / directory / resource).exists(), resource
    if directory != "base":
        assert "../base" in kustomization["resources"]
    else:
        files = {p.name for p in (DEPLOY / "base").glob("*.yaml")} - {"kustomization.yaml"}
        assert files == set(kustomization["resources"])


# -- the picker's invariants --------------------------------------------------------------------------


def _picker() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = one("Deployment", "vllm-qwen-epp")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return deployment, pod, container


def test_picker_probes_are_grpc_on_the_health_port() -> None:
    _, _, container = _picker()
    assert container["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert {p["containerPort"] for p in container["ports"]} == {9002, 9003, 9090}


def test_picker_runs_locked_down_with_resource_requests() -> None:
    _, pod, container = _picker()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] != 0
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert pod["spec"].get("hostNetwork") is not True and "privileged" not in security


def test_picker_arguments_start_discovery_of_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, pod, container = _picker()
    config = one("ConfigMap", "vllm-qwen-epp-config")
    # the config file the args name is the ConfigMap's key, mounted read-only
    (config_arg,) = [container["args"][i + 1] for i, a in enumerate(container["args"]) if a == "--config-file"]
    (mount,) = [m for m in container["volumeMounts"] if config_arg.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == config["metadata"]["name"] and mount["readOnly"] is True
    key = config_arg.removeprefix(mount["mountPath"] + "/")
    (tmp_path / key).write_text(config["data"][key])
    args = [str(tmp_path / key) if a == config_arg else a for a in container["args"]]
    (namespace_env,) = [e for e in container["env"] if e["name"] == "NAMESPACE"]
    assert namespace_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    monkeypatch.setenv("NAMESPACE", "llm")
    settings, not_yet = settings_from_args(args)
    assert not_yet == []
    assert settings.kube_discovery and settings.pool_name == one("InferencePool")["metadata"]["name"]
    assert settings.pool_namespace == "llm" and settings.metrics_endpoint_auth
    assert settings.grpc_port == 9002 and settings.grpc_health_port == 9003 and settings.metrics_port == 9090
    # the shutdown grace fits in the pod's termination grace period
    assert settings.shutdown_grace_seconds < pod["spec"]["terminationGracePeriodSeconds"]


def test_the_config_map_holds_a_config_the_picker_loads() -> None:
    config = one("ConfigMap", "vllm-qwen-epp-config")
    settings = Settings(
        config_text=config["data"]["epp-config.yaml"],
        endpoints=tuple(parse_endpoints("10.0.0.1:8000")),
        scrape_metrics=False,
    )
    EndpointPicker(settings)  # raises ConfigError naming the problem


def test_service_points_at_the_picker_and_the_pool_points_at_the_service() -> None:
    _, pod, container = _picker()
    service = one("Service", "vllm-qwen-epp")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {9002, 9090}
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[ports[9002]["targetPort"]] == 9002 and named[ports[9090]["targetPort"]] == 9090
    ref = one("InferencePool")["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref["port"]["number"] == 9002
    assert ref["failureMode"] == "FailOpen"


def test_rbac_is_least_privilege_in_the_namespace() -> None:
    # The only cluster-scoped objects: the review rights and the scraper's role (tested below).
    cluster = sorted((doc["kind"], doc["metadata"]["name"]) for _, doc in ALL if doc["kind"].startswith("Cluster"))
    assert cluster == [
        ("ClusterRole", "vllm-qwen-epp-auth-reviewer"),
        ("ClusterRole", "vllm-qwen-epp-metrics-reader"),
        ("ClusterRoleBinding", "vllm-qwen-epp-auth-reviewer"),
    ]
    _, pod, _ = _picker()
    account = one("ServiceAccount")
    assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
    role, binding = one("Role"), one("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"]}]
    granted = {}
    for rule in role["rules"]:
        assert set(rule["verbs"]) == {"get", "list", "watch"}
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted[(group, resource)] = rule.get("resourceNames")
    assert set(granted) == {
        ("", "pods"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("inference.networking.x-k8s.io", "inferenceobjectives"),
    }
    assert granted[("inference.networking.k8s.io", "inferencepools")] == [one("InferencePool")["metadata"]["name"]]


def test_the_picker_may_create_token_and_access_reviews_and_nothing_else_cluster_wide() -> None:
    # --metrics-endpoint-auth (on: the args leave it at its default, see the test above) asks for both reviews.
    _, pod, container = _picker()
    assert not [a for a in container["args"] if a.startswith("--metrics-endpoint-auth")]
    role = one("ClusterRole", "vllm-qwen-epp-auth-reviewer")
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ]
    binding = one("ClusterRoleBinding", "vllm-qwen-epp-auth-reviewer")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount" and subject["name"] == pod["spec"]["serviceAccountName"]
    assert subject["namespace"] == "llm"  # the namespace the README's kubectl apply -n uses


def test_the_scraper_role_may_get_metrics_and_only_that() -> None:
    role = one("ClusterRole", "vllm-qwen-epp-metrics-reader")
    # what the picker's SubjectAccessReview asks for a scrape (epp.server.metrics_auth): path /metrics, verb get
    assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]


def test_the_sample_model_server_is_what_the_pool_selects() -> None:
    pool = pool_spec(one("InferencePool"))
    vllm = one("Deployment", "vllm-qwen")
    labels = vllm["spec"]["template"]["metadata"]["labels"]
    assert dict(pool.selector).items() <= labels.items()
    assert labels[ENGINE_TYPE_LABEL] == "vllm"
    (container,) = vllm["spec"]["template"]["spec"]["containers"]
    assert set(pool.target_ports) <= {p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]  # Ready is what admits a pod to the pool
