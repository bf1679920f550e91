"""``example-locality-scorer``: prefer endpoints in the gateway's own zone.

Parameters:
    label (str, default ``topology.kubernetes.io/zone``): the endpoint label to compare.
    value (str, required): the preferred value; endpoints carrying it score 1.0, others 0.0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters, str_parameter


class LocalityScorer:
    reads_body = False  # it scores by endpoint labels: under --workers the request body need not be copied

    def __init__(self, name: str, label: str, value: str) -> None:
        self.name, self.label, self.value = name, label, value

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> LocalityScorer:
        check_parameters(name, parameters, ("label", "value"))
        if not parameters.get("value"):
            raise ValueError(f"{name}: value is required: the label value to prefer")
        value = str_parameter(name, parameters, "value", "")
        label = str_parameter(name, parameters, "label", "topology.kubernetes.io/zone")
        return cls(name, label, value)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return [1.0 if endpoint.labels.get(self.label) == self.value else 0.0 for endpoint in candidates]
