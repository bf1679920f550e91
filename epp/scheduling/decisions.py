"""Decision records: one structured line per request saying why it went where it went.

At ``-v 4`` or more (upstream's debug level; :func:`epp.server.logs.configure_logging` enables the
``epp.decisions`` logger there) the runner records, for each request, the candidates it started
with, what each filter kept, each scorer's score (and weight) for the best candidates, their totals,
the pick, and the per-request data that explains it (the prefix match, in tokens, of the best
candidates). The line is a JSON object, so a log pipeline can index it; nothing is recorded, and
nothing costs more than one ``isEnabledFor`` test, at the default verbosity.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from epp.framework import PREFIX_MATCH, Endpoint, InferenceRequest

__all__ = ["DecisionRecord", "decisions", "log_decision"]

decisions = logging.getLogger("epp.decisions")

_TOP = 5  # candidates whose scores a record lists, best first


class DecisionRecord:
    """What one profile did with one request (built only while decision records are on)."""

    __slots__ = ("candidates", "filters", "picked", "profile", "scored_candidates", "scores", "totals")

    def __init__(self, profile: str, candidates: Sequence[Endpoint]) -> None:
        self.profile = profile
        self.candidates = len(candidates)
        self.filters: list[tuple[str, list[str]]] = []
        self.scores: list[tuple[str, float, Sequence[float]]] = []  # scorer, weight, its scores
        self.totals: Sequence[float] = ()
        self.picked: list[str] = []
        self.scored_candidates: Sequence[Endpoint] = ()  # what the scorers saw (after the filters)

    def filtered(self, name: str, kept: Sequence[Endpoint]) -> None:
        self.filters.append((name, [e.name for e in kept]))

    def scored(self, name: str, weight: float, scores: Sequence[float]) -> None:
        self.scores.append((name, weight, scores))

    def as_dict(self) -> dict[str, Any]:
        """The record, the scores listed for the best-scoring of the candidates the scorers saw."""
        candidates = self.scored_candidates
        order = sorted(range(len(candidates)), key=lambda i: -self.totals[i] if i < len(self.totals) else 0.0)
        top = [
            {
                "endpoint": candidates[i].name,
                "total": round(self.totals[i], 4) if i < len(self.totals) else None,
                "scores": {name: round(float(s[i]), 4) for name, _, s in self.scores if i < len(s)},
            }
            for i in order[:_TOP]
        ]
        return {
            "profile": self.profile,
            "candidates": self.candidates,
            "filters": [
                {"filter": name, "kept": kept if len(kept) <= _TOP else len(kept)} for name, kept in self.filters
            ],
            "weights": {name: weight for name, weight, _ in self.scores},
            "top": top,
            "picked": self.picked,
        }


def log_decision(request: InferenceRequest, records: Sequence[DecisionRecord], primary: str) -> None:
    """Write one request's decision line (``records``: each profile's record)."""
    entry: dict[str, Any] = {
        "request_id": request.request_id,
        "model": request.model,
        "adapter": request.adapter,
        "primary_profile": primary,
        "profiles": [record.as_dict() for record in records],
    }
    match = request.state.get(PREFIX_MATCH)
    if match is not None and match.blocks:
        best = sorted(match.matched.items(), key=lambda item: -item[1])[:_TOP]
        entry["prefix_match_tokens"] = {name: blocks * match.block_tokens for name, blocks in best}
        entry["prompt_tokens_matched_of"] = match.blocks * match.block_tokens
    decisions.info("decision %s", json.dumps(entry, separators=(",", ":")))
