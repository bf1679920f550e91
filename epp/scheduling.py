"""The scheduling seam: from one request and the candidate endpoints to an ordered pick.

Design
------
:class:`Scheduler` runs one scheduling profile: filters narrow the candidates, scorers give each
remaining candidate a score in [0, 1] that is clamped, weighted and summed, and the picker turns
the scored list into the endpoints to try, primary first, then fallbacks. The scheduler is pure,
synchronous CPU work over immutable snapshots; everything asynchronous (admission, waiting for
capacity) lives in :mod:`epp.director` around it.

The plugin interfaces here are the public contract for plugin authors (see ``epp.plugins`` for the
built-ins, written only against this module). New capabilities arrive as optional attributes or
keyword arguments with defaults, never as new required methods.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from epp.datastore import Endpoint
from epp.request import InferenceRequest

__all__ = ["Filter", "Picker", "Profile", "ScoredEndpoint", "Scorer", "Scheduler", "WeightedScorer"]


@dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


@runtime_checkable
class Filter(Protocol):
    """Narrows the candidates; returning an empty list means no endpoint can take the request."""

    name: str

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores every candidate in [0, 1] (higher is better); one score per candidate, in order."""

    name: str

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the endpoints to try, primary first, from the scored candidates."""

    name: str

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    picker: Picker
    filters: tuple[Filter, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()


class Scheduler:
    """Runs a profile over the candidates of one request."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def schedule(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints to try, primary first; empty when no candidate survives the filters."""
        profile = self.profile
        for flt in profile.filters:
            if not candidates:
                break
            candidates = flt.filter(request, candidates)
        if not candidates:
            return []
        totals = [0.0] * len(candidates)
        for weighted in profile.scorers:
            scores = weighted.scorer.score(request, candidates)
            if len(scores) != len(candidates):
                raise RuntimeError(
                    f"scorer {weighted.scorer.name!r} returned {len(scores)} scores for {len(candidates)} candidates"
                )
            for i, value in enumerate(scores):
                # Clamp, and treat NaN as the worst score: a buggy scorer must not win.
                value = 0.0 if math.isnan(value) else min(1.0, max(0.0, value))
                totals[i] += weighted.weight * value
        scored = [ScoredEndpoint(endpoint, total) for endpoint, total in zip(candidates, totals)]
        return profile.picker.pick(request, scored)
