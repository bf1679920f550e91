"""``max-score-picker``: the highest-scoring endpoints, ties broken at random.

Parameters (upstream names):
    maxNumOfEndpoints (int, default 1): how many endpoints to return, best first; the extra ones
        are fallbacks Envoy may try in order.

Ties are broken at random (a deterministic tie-break would send every tie to the same endpoint):
with one endpoint to return, a uniform choice among the best; with more, a shuffle before a
stable sort by score.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework import DEFAULT_PICKER, CountedPicker, Endpoint, InferenceRequest, ScoredCandidates, ScoredEndpoint


class MaxScorePicker(CountedPicker):
    default_for = (DEFAULT_PICKER,)  # a profile without a picker gets this one (upstream's default)

    def __init__(
        self, name: str = "max-score-picker", *, max_num_of_endpoints: int = 1, seed: int | None = None
    ) -> None:
        super().__init__(name, max_num_of_endpoints=max_num_of_endpoints, seed=seed)

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        endpoints, scores = ScoredCandidates.columns(scored)
        if not endpoints:
            return []
        if self.max_num_of_endpoints == 1:  # one pass, no sort: the common case
            best = max(scores)
            ties = [i for i, score in enumerate(scores) if score == best]
            return [endpoints[ties[0] if len(ties) == 1 else self._random.choice(ties)]]
        order = list(range(len(endpoints)))
        self._random.shuffle(order)
        order.sort(key=scores.__getitem__, reverse=True)
        return [endpoints[i] for i in order[: self.max_num_of_endpoints]]
