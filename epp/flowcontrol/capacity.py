"""The capacity limit: a prompt too large for the free KV-cache of every pod.

Design
------
A model server admits a request only when its prompt's KV blocks fit in free cache memory; a pod
that cannot fit it keeps it waiting (vLLM's scheduler stops at the head of its queue) or preempts
running work. The scorers only *prefer* pods with free cache; this step makes two hard decisions
from each pod's cache geometry (``num_gpu_blocks`` and ``block_size``, scraped from
``vllm:cache_config_info``) and KV-cache usage:

* a prompt larger than **every** pod's whole cache (``num_gpu_blocks × block_size`` tokens) can never
  run anywhere: it is refused with **413** before it queues (:func:`check_prompt_fits`);
* a prompt that fits no pod's **free** cache (``total × (1 − usage)``, with usage including the
  prompts this picker sent since the last scrape, :attr:`epp.datalayer.datastore.Endpoint.kv_usage`) but fits
  some pod's whole cache goes to the pod with the most free cache, where it waits the least
  (:func:`place_by_free_kv`, applied to the candidates after admission, before the scheduler runs;
  ties keep every tied pod and let the scheduler choose among them).

Where it runs: in the director, around admission. The 413 check runs first (waiting in the queue
for capacity that can never exist is pointless); the placement runs on the snapshot taken when the
request leaves the queue, since free cache is what changes while it waits.

Limits, deliberately: prompt tokens are :attr:`epp.extproc.parsing.InferenceRequest.prompt_tokens`, an
estimate at four characters per token (the picker has no tokenizer), and the output the request
will generate is not counted (vLLM allocates it as it decodes). Both steps act only when every
candidate reports its geometry: a pod that does not (another engine, not scraped yet) might hold the
prompt, so nothing is refused or narrowed on a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.errors import EppError, Reason
from epp.framework import Endpoint

__all__ = ["check_prompt_fits", "kv_capacity", "place_by_free_kv"]


def kv_capacity(endpoint: Endpoint) -> tuple[int, float] | None:
    """(total, free) KV-cache tokens of ``endpoint``; None when its geometry is unknown."""
    metrics = endpoint.metrics
    if not metrics.num_gpu_blocks or not metrics.block_size:
        return None
    total = metrics.num_gpu_blocks * metrics.block_size
    return total, total * (1.0 - endpoint.kv_usage)


def check_prompt_fits(prompt_tokens: int, candidates: Sequence[Endpoint]) -> None:
    """EppError(PROMPT_TOO_LARGE) when the prompt exceeds every candidate's whole KV-cache.

    Stops at the first candidate that could hold it (or does not report its geometry): the usual
    case costs one look, not one per pod.
    """
    if prompt_tokens <= 0 or not candidates:
        return
    largest = 0
    for endpoint in candidates:
        metrics = endpoint.metrics
        if not metrics.num_gpu_blocks or not metrics.block_size:
            return
        total = metrics.num_gpu_blocks * metrics.block_size
        if total >= prompt_tokens:
            return
        largest = max(largest, total)
    raise EppError(
        Reason.PROMPT_TOO_LARGE,
        f"the prompt (about {prompt_tokens} tokens, estimated at 4 characters per token) is larger than "
        f"the KV-cache of every model server in the pool (the largest holds {largest} tokens)",
    )


def place_by_free_kv(prompt_tokens: int, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]:
    """``candidates`` unchanged when the prompt fits some candidate's free KV-cache (or geometry is
    unknown); otherwise the candidates with the most free KV-cache. Stops at the first candidate
    the prompt fits (or of unknown geometry)."""
    if prompt_tokens <= 0 or len(candidates) < 2:
        return candidates
    capacities = []
    for endpoint in candidates:
        capacity = kv_capacity(endpoint)
        if capacity is None or capacity[1] >= prompt_tokens:
            return candidates
        capacities.append(capacity)
    most = max(free for _, free in capacities)
    return [endpoint for endpoint, (_, free) in zip(candidates, capacities, strict=False) if free == most]
