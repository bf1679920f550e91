"""InferenceObjective resources: which priority each objective name carries, for one pool.

An ``InferenceObjective`` (``inference.networking.x-k8s.io/v1alpha2``, namespaced) gives a name that
requests select with the ``x-llm-d-inference-objective`` / ``x-gateway-inference-objective`` header
a ``spec.priority`` (an int32; unset means 0). It applies to the pools it references:
``spec.poolRef.name``, any ``spec.poolRefs[*].name``, or ``spec.poolSelector`` (a label selector
over the pools of its namespace; an empty one selects every pool). Pure functions here; discovery
(:mod:`epp.kube.discovery`) lists and watches the namespace's objectives with a
:class:`~epp.kube.reflector.Reflector` and hands :func:`objective_priorities`' table to
:meth:`epp.flowcontrol.objectives.Objectives.set_discovered` after every change.

An objective whose priority is not an int32 is skipped with a warning (the CRD's validation makes
that unlikely); it then resolves to the default priority, like an unknown name.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from epp.flowcontrol.objectives import check_priority

__all__ = [
    "OBJECTIVE_GROUP",
    "OBJECTIVE_PLURAL",
    "OBJECTIVE_VERSION",
    "objective_applies",
    "objective_priorities",
    "selector_matches",
]

log = logging.getLogger(__name__)

OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"
OBJECTIVE_PLURAL = "inferenceobjectives"


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes ``LabelSelector`` (matchLabels and matchExpressions) against ``labels``."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        if not isinstance(expression, Mapping):
            return False
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or []
        # A key that is not a string (the CRD forbids it) names no label: the label counts as absent.
        value = labels.get(key) if isinstance(key, str) else None
        present = value is not None  # label values are strings, never None
        if operator == "In" and value not in values:
            return False
        if operator == "NotIn" and present and value in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False  # an operator the API does not define selects nothing
    return True


def objective_applies(objective: Mapping[str, Any], pool_name: str, pool_labels: Mapping[str, str]) -> bool:
    """Whether ``objective`` references the pool ``pool_name`` (whose labels are ``pool_labels``)."""
    spec = objective.get("spec") or {}
    ref = spec.get("poolRef")
    if isinstance(ref, Mapping) and ref.get("name") == pool_name:
        return True
    for ref in spec.get("poolRefs") or []:
        if isinstance(ref, Mapping) and ref.get("name") == pool_name:
            return True
    selector = spec.get("poolSelector")
    return isinstance(selector, Mapping) and selector_matches(selector, pool_labels)


def objective_priorities(
    objectives: Iterable[Mapping[str, Any]], pool_name: str, pool_labels: Mapping[str, str] | None = None
) -> dict[str, int]:
    """Objective name -> priority, for the objectives that apply to the pool."""
    table: dict[str, int] = {}
    for objective in objectives:
        name = (objective.get("metadata") or {}).get("name")
        if not name or not objective_applies(objective, pool_name, pool_labels or {}):
            continue
        try:
            table[name] = check_priority((objective.get("spec") or {}).get("priority"), f"InferenceObjective {name}")
        except ValueError as exc:
            log.warning("%s; the objective is ignored", exc)
    return table
