"""InferenceObjectives: the config section, the Kubernetes resources and their watch.

The watch runs the real client library against the fake API server (epp.testing.fake_apiserver)
with the InferenceObjective resource registered, over real sockets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epp.datalayer.datastore import Datastore
from epp.flowcontrol.objectives import Objectives
from epp.kube.discovery import Discovery
from epp.kube.objectives import objective_applies, objective_priorities, selector_matches
from epp.testing.fake_apiserver import INFERENCE_POOLS, PODS, FakeApiServer, Resource, make_pool

NS = "default"


POOL = "pool"


OBJECTIVES = Resource("inference.networking.x-k8s.io", "v1alpha2", "inferenceobjectives", "InferenceObjective")


def objective(name: str, priority: Any = None, *, pool: str | None = POOL, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = dict(spec)
    if priority is not None:
        body["priority"] = priority
    if pool is not None:
        body["poolRef"] = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool}
    return {
        "apiVersion": OBJECTIVES.api_version,
        "kind": OBJECTIVES.kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": body,
    }


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ({}, {}, True),  # v1alpha2: an empty selector selects every pool of the namespace
        ({"matchLabels": {"tier": "gold"}}, {"tier": "gold", "x": "y"}, True),
        ({"matchLabels": {"tier": "gold"}}, {"tier": "silver"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold", "silver"]}]}, {"tier": "silver"}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]}, {"tier": "gold"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["gold"]}]}, {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Near"}]}, {"tier": "x"}, False),
    ],
)
def test_pool_selectors(selector: dict[str, Any], labels: dict[str, str], matches: bool) -> None:
    assert selector_matches(selector, labels) is matches


def test_objectives_apply_by_pool_ref_pool_refs_or_selector() -> None:
    assert objective_applies(objective("a"), POOL, {})
    assert not objective_applies(objective("a", pool="other"), POOL, {})
    refs = objective("b", pool=None, poolRefs=[{"name": "other"}, {"name": POOL}])
    assert objective_applies(refs, POOL, {})
    by_label = objective("c", pool=None, poolSelector={"matchLabels": {"tier": "gold"}})
    assert objective_applies(by_label, POOL, {"tier": "gold"}) and not objective_applies(by_label, POOL, {})
    assert not objective_applies(objective("d", pool=None), POOL, {"tier": "gold"})


def test_priorities_of_the_applying_objectives() -> None:
    found = objective_priorities(
        [objective("chat", 10), objective("unset"), objective("elsewhere", 99, pool="other"), objective("bulk", -1)], POOL
    )
    assert found == {"chat": 10, "unset": 0, "bulk": -1}


def test_an_objective_with_a_bad_priority_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    assert objective_priorities([objective("bad", "high"), objective("ok", 1)], POOL) == {"ok": 1}
    assert "InferenceObjective bad: priority must be an integer" in caplog.text


async def eventually(predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)


async def test_discovery_keeps_the_objectives_of_the_pool_current(tmp_path: Path) -> None:
    async with FakeApiServer((PODS, INFERENCE_POOLS, OBJECTIVES), bookmark_interval=0.1) as api:
        pool = make_pool(POOL, {"app": "vllm"}, [8000])
        pool["metadata"]["labels"] = {"tier": "gold"}
        api.apply(pool)
        api.apply(objective("chat", 10))
        api.apply(objective("other-pool", 5, pool="other"))
        objectives = Objectives({"chat": 1, "bulk": -1})
        discovery = Discovery(
            Datastore(), namespace=NS, pool_name=POOL, kubeconfig=str(api.kubeconfig(tmp_path / "kc")), backoff=(0.02, 0.2), objectives=objectives
        )
        await discovery.start()
        try:
            await eventually(lambda: objectives.discovered == {"chat": 10}, "the first list")
            assert objectives.resolve({"x-gateway-inference-objective": "chat"}) == ("chat", 10)  # the cluster wins
            assert objectives.priority("bulk") == -1  # configured ones stay

            api.apply(objective("bulk", -5))  # a watch event: ADDED
            api.apply(objective("gold", 7, pool=None, poolSelector={"matchLabels": {"tier": "gold"}}))
            await eventually(lambda: objectives.discovered == {"chat": 10, "bulk": -5, "gold": 7}, "the added objectives")
            assert objectives.priority("bulk") == -5

            api.update(OBJECTIVES, NS, "chat", lambda obj: obj["spec"].update(priority=20))  # MODIFIED
            api.delete(OBJECTIVES, NS, "bulk")  # DELETED: the configured priority is back
            await eventually(lambda: objectives.discovered == {"chat": 20, "gold": 7}, "the change and the deletion")
            assert objectives.priority("bulk") == -1

            api.update(INFERENCE_POOLS, NS, POOL, lambda obj: obj["metadata"].update(labels={"tier": "silver"}))
            await eventually(lambda: objectives.discovered == {"chat": 20}, "the pool's labels changing")
            api.drop_watches()  # a dropped connection resumes the watch
            api.apply(objective("late", 3))
            await eventually(lambda: objectives.priority("late") == 3, "an objective added after a dropped watch")
        finally:
            await discovery.stop()
