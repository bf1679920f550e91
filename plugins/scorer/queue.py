"""``queue-scorer``: prefer the endpoint with the shortest waiting queue.

Upstream semantics: min-max normalisation over the candidates' waiting-queue lengths,
``(max - queue) / (max - min)``: the shortest queue scores 1.0, the longest 0.0, and when every
candidate has the same queue all score 1.0 (nothing to tell them apart).

The queue read is :attr:`epp.framework.Endpoint.queue_ahead`: the scraped waiting-queue length plus
the requests this picker sent to the endpoint after that scrape was taken, so a burst between two
scrapes spreads instead of herding onto the endpoint that looked idle.

Departure from upstream (which reads the scraped waiting queue alone): a request this picker sent
counts as queued until its response starts, since a pod prefilling a long prompt reports an empty
waiting queue yet a new request there waits behind that prefill; and the one the pod is prefilling
counts between 1 and 0.5 by how much of its expected prefill is left (learned per pod from the
picker's own requests; :meth:`epp.framework.InFlightView.pending_depth`). With every pod busy
prefilling one prompt, whole counts tie and the KV-cache scorer alone decides, which sends the
request after a prefill that has just started as readily as after one about to end; on workload c
of ``bench/routing_quality.py`` (unique prompts, 70% load) that made the default profile's TTFT P90
worse than round robin's. The order of pods with different whole counts is unchanged, and a pod
with nothing unanswered still ranks before any pod with a prefill under way.

An endpoint whose metrics are stale counts as fully loaded: it scores 0.0 and takes no part in the
normalisation.

No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epp.framework import Endpoint, Handle, InferenceRequest, check_parameters, lower_is_better


class QueueScorer:
    def __init__(self, name: str = "queue-scorer") -> None:
        self.name = name

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> QueueScorer:
        check_parameters(name, parameters)
        return cls(name)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        return lower_is_better([None if e.metrics.stale else e.queue_ahead for e in candidates])
