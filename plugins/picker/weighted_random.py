"""``weighted-random-picker``: picks at random, each endpoint with probability proportional to its score.

Upstream semantics: weighted sampling without replacement by A-Res (Efraimidis and Spirakis):
every candidate with a positive score draws ``u`` uniform in (0, 1] and gets the key
``u ** (1 / score)``; the largest keys win, in order. The first endpoint returned is therefore
candidate ``i`` with probability ``score_i / sum(scores)``, and each fallback is drawn the same way
from those left. Candidates scoring 0 are never chosen ahead of one with a positive score; they
only fill the remaining places (in random order) when ``maxNumOfEndpoints`` asks for more. When no
candidate has a positive score, the pick is uniform, as ``random-picker``'s.

Keys are compared as ``log(u) / score``, the logarithm of upstream's key: the same order, without
underflow to 0 when a score is tiny.

Parameters (upstream names):
    maxNumOfEndpoints (int, default 1): how many endpoints to return, primary first; the extra ones
        are fallbacks Envoy may try in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epp.framework import CountedPicker, Endpoint, InferenceRequest, ScoredEndpoint


class WeightedRandomPicker(CountedPicker):
    def __init__(
        self, name: str = "weighted-random-picker", *, max_num_of_endpoints: int = 1, seed: int | None = None
    ) -> None:
        super().__init__(name, max_num_of_endpoints=max_num_of_endpoints, seed=seed)

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]:
        count = min(self.max_num_of_endpoints, len(scored))
        draw = self._random.random
        weighted: list[tuple[float, Endpoint]] = []
        unweighted: list[Endpoint] = []
        for item in scored:
            # NaN fails the comparison and counts as 0, as the runner counts it.
            if item.score > 0.0:
                # 1 - random() lies in (0, 1]: log() never sees 0.
                weighted.append((math.log(1.0 - draw()) / item.score, item.endpoint))
            else:
                unweighted.append(item.endpoint)
        if not weighted:
            return [item.endpoint for item in self._random.sample(scored, count)]
        weighted.sort(key=lambda pair: pair[0], reverse=True)
        picked = [endpoint for _, endpoint in weighted[:count]]
        if len(picked) < count:
            picked.extend(self._random.sample(unweighted, count - len(picked)))
        return picked
