"""``prefix-cache-scorer``: send a prompt where its prefix is cached.

Gives each candidate the share of the prompt's blocks it is predicted to hold from the first one on
(matched blocks / prompt blocks; 0 for a prompt shorter than a block), as the configured prefix
producer found it (:data:`epp.framework.PREFIX_MATCH`). With no producer of that data in the config,
the registry's default one (``approx-prefix-cache-producer``) is added, built from this scorer's
parameters, as upstream's scorer brings its own index.

Parameters: those of ``approx-prefix-cache-producer`` (upstream names; checked here, so a bad one
names this plugin): blockSizeTokens, blockSize, hashBlockSize, maxPrefixTokensToMatch,
maxPrefixBlocksToMatch, lruCapacityPerServer, autoTune.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

from epp.framework import PREFIX_MATCH, Endpoint, Handle, InferenceRequest

from ..producer.approx_prefix_cache import PrefixParameters

__all__ = ["PrefixCacheScorer"]


class PrefixCacheScorer:
    consumes = (PREFIX_MATCH,)

    def __init__(self, name: str = "prefix-cache-scorer", parameters: Mapping[str, Any] | None = None) -> None:
        self.name = name
        # What the default producer is built from, when the config has none.
        self.producer_parameters = dict(parameters or {})

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        PrefixParameters.parse(name, parameters)  # refuse bad parameters here, naming this plugin
        return cls(name, parameters)

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[float]:
        match = request.state.get(PREFIX_MATCH)
        if match is None or not match.blocks:
            return [0.0] * len(candidates)
        total = match.blocks
        matched = match.matched
        return [matched.get(endpoint.name, 0) / total for endpoint in candidates]
