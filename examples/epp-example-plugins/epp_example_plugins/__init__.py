"""``example-locality-scorer``: prefer endpoints in the gateway's own zone.

Parameters:
    label (str, default ``topology.kubernetes.io/zone``): the endpoint label to compare.
    value (str, required): the preferred value; endpoints carrying it score 1.0, others 0.0.
"""

from epp.scheduling.registry import check_parameters


class LocalityScorer:
    def __init__(self, name, label, value):
        self.name = name
        self.label = label
        self.value = value

    @classmethod
    def from_config(cls, name, parameters, handle):
        check_parameters(name, parameters, ("label", "value"))
        value = parameters.get("value")
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}: value is required: the label value to prefer")
        label = parameters.get("label", "topology.kubernetes.io/zone")
        return cls(name, label, value)

    def score(self, request, candidates):
        return [1.0 if endpoint.labels.get(self.label) == self.value else 0.0 for endpoint in candidates]
