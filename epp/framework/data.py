"""Per-request data with a well-known key, shared by plugins of different authors.

``PREFIX_MATCH``: how much of the request's prompt each pod is predicted to hold in its KV-cache.
The prefix-cache producers (``approx-prefix-cache-producer``, which predicts from what this picker
sent; a precise producer, from the engines' own KV-cache events) write it; ``prefix-cache-scorer``
reads it. Any producer that writes it feeds that scorer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from epp.framework.request import StateKey

__all__ = ["PREFIX_MATCH", "PrefixMatch"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The prompt's blocks, and per endpoint the consecutive blocks from the start it holds.

    ``blocks``: prompt blocks considered (0 for a prompt shorter than a block). ``matched``: endpoint
    name -> blocks matched from the first one (absent: 0). ``block_tokens``: tokens per block.
    """

    blocks: int
    matched: Mapping[str, int]
    block_tokens: int = 16

    def share(self, endpoint_name: str) -> float:
        """The share of the prompt's blocks ``endpoint_name`` holds, 0..1 (0 for an empty prompt)."""
        return self.matched.get(endpoint_name, 0) / self.blocks if self.blocks else 0.0


PREFIX_MATCH: StateKey[PrefixMatch] = StateKey("prefix-cache-match")
