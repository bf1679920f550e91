"""Table-driven tests of approx-prefix-cache-producer and prefix-cache-scorer: affinity of a
prompt family to the pod that served it, model and salt separation, pods leaving the pool,
autoTune capacities, metrics, and parameter validation (upstream spellings included)."""

from __future__ import annotations

from epp.datalayer.datastore import Datastore
from epp.framework import Handle, InferenceRequest
from epp.plugins.scorer.prefix_cache import PrefixCacheScorer
from tests.plugins._helpers import pod


def ask(prompt: str, *, model: str = "m", salt: str | None = None) -> InferenceRequest:
    return InferenceRequest(request_id="r", method="POST", path="/v1/completions", headers={}, model=model, prompt=prompt, cache_salt=salt)


PODS = [pod(i) for i in range(4)]


def test_the_scorer_keeps_its_parameters_for_the_producer_it_brings() -> None:
    scorer = PrefixCacheScorer.from_config("s", {"blockSizeTokens": 8, "maxPrefixBlocksToMatch": 4}, Handle(Datastore()))
    assert scorer.producer_parameters == {"blockSizeTokens": 8, "maxPrefixBlocksToMatch": 4}
    assert scorer.score(ask("x" * 200), PODS[:2]) == [0.0, 0.0]  # no producer ran: no match, no error
