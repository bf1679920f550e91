"""``precise-prefix-cache-producer``: PREFIX_MATCH from the pods' own KV-cache events (llm-d's type name).

Where the approximate producer predicts what a pod holds from what this picker sent it, this one
follows what the pods say they hold: a :class:`epp.prefix.kvsubscriber.KVEventSubscriber` connects to
each pod's publisher, or, with ``kvEventsConfig.zmqEndpoint``, binds that endpoint for pods configured
to connect to it. The events fill a :class:`epp.prefix.kvindex.KVEventIndex` keyed by this picker's
hash of the blocks' token ids; a request is looked up with its own token ids, cut into the events'
block size, with its adapter's name and ``cache_salt`` as vLLM puts them in a block's extra keys.

Pod identity comes from the pool, never from a topic alone. Connecting, the publisher of endpoint
``ip:port`` is dialled at ``tcp://ip:<kv port>``, the port the pool gives it
(:attr:`Endpoint.kv_events_port`: a static file's ``kv-events=PORT``, a pod's container port named
``kv-events`` as llm-d's guides name it), else ``podDiscoveryConfig.socketPort`` (5557, vLLM's default
``tcp://*:5557``); its replay socket at :attr:`Endpoint.kv_replay_port` (``kv-replay``) when given. The
socket says whose events they are; a topic that names another pod is applied to the socket's pod and
counted. Binding, a message is taken only when its topic names a pool endpoint (``kv@<ip>[:<port>]@<model>``,
llm-d's ``kv@<pod ip>@<model>`` included) *and* it came from that endpoint's address; the replay socket,
which vLLM binds in either mode, is dialled the same way. A server running data-parallel ranks
behind one endpoint (``vllm serve --data-parallel-size N``, vLLM balancing among its engines) says so
at ``GET /kv_event_sources``, which each endpoint's server is asked once (:mod:`epp.prefix.kvsources`):
the other ranks' publishers are followed too (rank r's blocks count for the endpoint), or, binding,
their ports (the bound one + r) bound. Each endpoint
followed is logged (``KV events: following ...``); every message dropped or flagged is logged (at most
once a minute per pod and reason) and counted in ``epp_kv_event_rejected_total{reason}``: ``topic``
(not under ``topicFilter``, e.g. vLLM's default empty topic), ``identity`` (names another pod),
``unknown_pod``, ``peer``, ``ambiguous``. A setup that would leave scores stuck at 0 shows there.

Token ids (see "Tokenization" below) come from the served model's own tokenizer files when the
picker has them (:mod:`epp.prefix.tokenize`: HF ``tokenizers`` and the chat template rendered as
vLLM renders it, a conversation's earlier turns reused), else from the engine's ``/tokenize`` (or
render) endpoint (:mod:`epp.prefix.remote`), else not at all: that request is scored by the
approximate index alone, and counted. A :data:`Tokenizer` callable given to the constructor
replaces all of it (tests, embedding).

Pods without events. A pool may mix pods that publish events with pods that do not: an inner
:class:`ApproxPrefixCacheProducer` (same parameters) serves those, and a pod's match is the precise one
while the index :meth:`~epp.prefix.kvindex.KVEventIndex.known`\\s the pod, else the approximate one
scaled to the precise blocks. Matches count blocks weighted by medium (a CPU block 0.8), rounded down.
When every candidate's events are followed without a hole (the usual case: a pool of engines that
publish) the approximate index is neither looked up nor fed: its answer would be dropped for every
pod. It is consulted and fed again as soon as one candidate is not known (before its first event,
after a hole until the next batch), and always when the prompt's ids are missing (no tokenizer, a
timeout). What that gives up: the approximate index holds no picks of a publishing pod made while all
were followed, so during a hole, which lasts until that pod's next batch, the pod has no approximate
match either. What it saves, side by side with the code before (81a9a1e as ``precise@PATH``):
``python bench/precise_routing.py --workloads b --policies precise,precise@PATH --rounds 3
--envoy-timing``, per round: the picker's CPU 3.57 / 3.91 / 4.07 ms a request against 4.78 / 4.70 /
4.86; the pick as Envoy times it P50 1.65 / 1.76 / 1.83 ms against 2.11 / 2.13 / 2.17, P90 2.92 /
3.19 / 3.26 against 4.08 / 4.00 / 4.16; ``produce`` 0.35-0.39 ms against 0.52-0.55 and
``pre_request`` 0.70-0.79 against 1.14-1.18 (means, in place). In a hot loop (``python
bench/tokenize_cost.py --sizes 2000,8000 --runs 15``, twice each) a warm 8k-token chat's ``produce``
0.09-0.10 ms against 0.19-0.20, its ``pre_request`` 0.44-0.45 against 0.51-0.53.

Parameters (llm-d's names where they exist, plus the approximate producer's):
    kvEventsConfig.zmqEndpoint (str): bind this endpoint for pods that connect (default: connect to pods);
        its port + r too for data-parallel rank r, where vLLM's rank r connects, when the pool has r + 1
        endpoints on one ip or a server reports r + 1 ranks.
    kvEventsConfig.topicFilter (str, default "kv@"): the prefix a message's topic must have.
    kvEventsConfig.concurrency, kvEventsConfig.discoverPods: accepted (llm-d's); one subscriber on the
        picker's event loop serves every pod, and pods are always the pool's.
    kvEventsConfig.podDiscoveryConfig.socketPort (int, default 5557; also at the top level): the pods'
        publisher port when the pool does not name one. ``podLabelSelector``, ``podNamespace``:
        accepted, unused (the pool's pods are followed).
    tokenProcessorConfig.blockSize (int, default 16): tokens per block of a lookup before any event said.
    tokenProcessorConfig.hashSeed (int, default 0): the seed of this picker's block keys.
    maxBlocksPerPod (int, default 1048576): this project's bound on the blocks remembered per pod.
    inFlightTTL (Go duration, default "30s"; "0s": off): this project's. The blocks a request sent to a
        pod will compute count as that pod's from the moment it is sent until the pod's events store
        them (a prefill's length, usually), or for this long if they never do: without it, a second
        request of a prefix arriving while the first is prefilling would not find it anywhere.
    indexerConfig.tokenizersPoolConfig: the tokenizer (llm-d's section; its keys below).

``indexerConfig.tokenizersPoolConfig`` (llm-d's names first, then this project's):
    modelName (str): the served model whose tokenizer is loaded; requests for any model not in
        ``local.modelTokenizerMap`` (its LoRA adapters among them) use it.
    workersCount (int, default 2): threads that tokenize (a long prompt is tokenized off the event
        loop; HF ``tokenizers`` releases the GIL while it encodes); as many again encode what waits
        for the answer (see "After the answer").
    local.autoDiscoveryDir (str, default "/mnt/models"): where ``<modelName>/tokenizer.json`` is
        looked for (also ``$LOCAL_TOKENIZER_DIR``; a directory holding ``tokenizer.json`` itself, or a
        mounted ConfigMap of the model's tokenizer files, works too).
    local.autoDiscoveryTokenizerFileName (str, default "tokenizer.json").
    local.modelTokenizerMap (map model name -> path of a tokenizer.json, or of its directory).
    hf, uds: accepted only null (or ``hf.enabled: false``): nothing is ever downloaded, and llm-d's
        tokenizer sidecar is not used (the engine's ``/tokenize`` is the remote fallback).
    minPrefixOverlapRatio: accepted, unused (a conversation's prefix is reused exactly, or not).
    chatTemplate (str): the server's ``--chat-template``, a file or the template's text.
    prefixCacheBytes (int, default 134217728): the bound of the reused-prefix cache, per model.
    timeout (Go duration, default "500ms"): how long a request waits for its local tokenization;
        past it the request goes on with the approximate match, and the tokenization finishes
        anyway (the next turn of the conversation finds it cached).
    remote.mode ("tokenize", "render" or "none"; default "tokenize"): the fallback when no local
        files serve the model: the engine's ``/tokenize``, its render endpoints (vLLM with
        ``--enable-scale-out``), or none.
    remote.url (str): the engine to ask (``http://host:port``); default: the pool's pods in turn.
    remote.timeout (Go duration, default "250ms"), remote.failureThreshold (int, default 5),
    remote.cooldown (Go duration, default "5s"): the call's bound and its circuit breaker (after
        that many consecutive failures no call is made for the cooldown, doubled each time a retry
        fails, up to 16x).

Tokenization, where it runs: ``prepare_data`` (the framework's asynchronous role, awaited by the
director before admission; see :mod:`epp.framework.roles`) computes the ids and leaves them in
``request.state[TOKENIZED_PROMPT]``; ``produce``, synchronous like every scheduling step, only reads
them. Decoding the body, rendering the template and looking up the reused prefix run on the event
loop (they hold the GIL anyway); the encoding of what is left runs there too when it is under 16 KiB
of text (a thread hop costs more), else on the worker threads, awaited with ``timeout`` - unless it
can wait for the answer (below: "A warm turn's new text", "A cold prompt's head", "After the
answer"). The remote call is awaited there too. Without ``prepare_data`` (a scheduler that does not
call it), ``produce`` tokenizes locally, inline.

A warm turn's new text. The next turn of a conversation starts with what its earlier turns left in the
tokenizer's cache (:attr:`epp.prefix.tokenize.Plan.known`: the ids through the last cut point reused),
and what follows - the previous answer, the new message, the generation prompt - is the part to
encode: ~1 µs a token, the largest part of a warm turn's tokenization, on the request's path. It can
wait for the answer. Block keys are chained, so a pod's match can run into the new text only if it
holds every block of the known start; when at most one pod does (a conversation lives on one pod), the
request is looked up by the known start alone, and the new text is encoded in ``pre_request``, which
runs once the pick's answer is written: then the ids are whole (``TOKENIZED_PROMPT``), and the blocks
the pod will compute are counted in flight there from the whole prompt, before the next pick. The one
pod's match can then read short by the blocks of the new text it holds (after a turn through this
picker: the previous answer's few blocks), which only makes it look less attractive than it is, never
another pod more; the prompt's length in blocks, the score's denominator, is estimated at the known
start's bytes per token. When two or more pods hold all the known start, the new text could tell them
apart: it is encoded at once and the lookup is exact. New text under 256 bytes is always encoded at
once (it costs less than a lookup), and so is a truncated prompt, or a cold one without a head
(below). When another configured plugin declares that it consumes ``TOKENIZED_PROMPT`` (startup tells
the producer: ``data_consumed``), nothing is put off: the ids are there before the pick, as that
plugin expects; a producer built outside a config (nobody told it) puts nothing off either.
``epp_tokenize_deferred_requests`` counts the requests looked up so; ``epp_tokenize_duration_seconds``
times what ran before the lookup. Measured side by side with the code before (624342e, run
as ``precise@PATH``: ``python bench/precise_routing.py --workloads b --policies
precise,precise@PATH,default,sglang-router --rounds 3 --envoy-timing``, at d73d994, medians of 3): the
pick as Envoy times it (the request's last byte in to the upstream request's first byte out) P50
1.93 / 2.02 / 2.12 ms against 2.64 / 2.56 / 3.07, P90 3.55 / 3.59 / 4.17 against 4.52 / 3.94 / 5.04
(approximate 1.27-1.42 and 1.90-2.22); the same requests' TTFT minus sglang-router's, median, +3.3
ms against +4.0 (approximate +2.4); hit rates 100% of the oracle either way. The CPU is the same, in
another place (``python bench/tokenize_cost.py``, warm 100k-token chat, three alternations: before
the answer 4.66 / 5.07 / 4.32 ms against 7.10 / 6.64 / 7.86, in all 6.96 / 7.37 / 6.91 against 7.22 /
6.80 / 8.13 on a busy machine).

A cold prompt's head. A long prompt the tokenizer has nothing of is planned with its head's ids as its
known start (``Plan.head``: its first ~500 bytes encoded alone, see :mod:`epp.prefix.tokenize`). Keys
are chained, so a pod that does not hold a prompt's first block holds none of it: when no pod (nor
what is in flight to one) holds the head's first block, every match is 0, exactly what the whole
ids would give, and the whole is encoded in ``pre_request``, after the answer. When any pod holds
it, the rest is encoded at once and the lookup is exact, as before: a head says nothing of how much
more of the prompt that pod holds. Once the whole ids are there, they are checked to start with the
head; a difference (``epp_tokenize_head_mismatches``: none in the tests' tokenizers, over random
texts) means the lookup may have missed a holder. Over workload b's first turns (``python
bench/tokenize_cost.py --trace-sessions 150``, side by side with 81a9a1e, three alternations, means):
CPU before the answer 0.40-0.44 ms a request against 1.76-2.00; in all 1.97-2.09 against 1.96-2.19
(the head's own encoding, ~0.1 ms, is within the runs' scatter).

After the answer. A rest put off (a warm turn's new text, a cold prompt past its head) is encoded in
``pre_request``: on the event loop under 8 KiB of text, on the worker threads from 8 KiB (a 100k-token
prompt is ~130 ms of encoding; on the loop it would hold every other request that long). From the
threads the ids come back to the loop, where they are recorded as ``pre_request`` records them
itself (``TOKENIZED_PROMPT``, the blocks sent in flight); meanwhile the known start's (or head's)
blocks are in flight on the pod picked from the moment of the pick, so a request of the same prefix
arriving in between is still sent there (its match short by the rest, the other pods' 0), and a
block the pod's events stored before the ids came back is not put in flight. These encodings have
threads of their own (``workersCount`` more), so that a backlog of them never delays an encoding a
pick awaits; at most 64 MiB of text waits for them (``epp_tokenize_after_answer_backlog_bytes``), and a
rest beyond that is not encoded (``epp_tokenize_after_answer_dropped``: its pick was made; its ids
would come too late to count its blocks in flight, and the next turn of its conversation finds no
reused prefix). The hop costs CPU:
with the threshold at 2 KiB, workload b's first turns (1-4.5 KB) cost 2.41-2.60 ms in all against
2.05-2.14 (``python bench/tokenize_cost.py --trace-sessions 150``, side by side with e245542, twice),
~0.15-0.4 ms a hop; at 8 KiB the hop is under a tenth of the encoding it moves. A rest over 16 KiB,
which the loop never encodes, cannot wait for ``produce`` to decide (``produce`` is synchronous): it
is put off only when ``prepare_data`` has decided it, over the whole pool rather than the
candidates (every endpoint's events followed, and the head's first block held by none, or the known
start held whole by at most one), else encoded on the threads before the pick as before. Measured
side by side with e245542 (``python bench/tokenize_cost.py --sizes 8000,100000 --runs 5``, twice
each, medians), CPU before the answer for a cold chat prompt: 8k tokens 2.0-2.1 ms against
12.1-13.8, 100k tokens 5.2-6.2 against 145-150 (in all the same: 11.5-12.3 against 12.2-13.9,
152-157 against 147-152); cold completions 0.28-0.34 against 8.1-8.4 (8k), 1.3-1.7 against 124-128
(100k); warm requests and b's turns unchanged. Through Envoy (``python bench/precise_routing.py
--workloads b,c --policies precise,precise@PATH,sglang-router --rounds 2 --envoy-timing``, PATH
e245542): on c (unique prompts of 2-6k tokens, 8-24 KB) the request phase as Envoy times it P50
1.59-1.61 ms against 5.14-5.51, P90 4.0-4.2 against 7.3-8.2, ``pre_request`` on the loop 0.12 ms a
request against 1.6-1.8 (means); the same requests' TTFT minus sglang-router's, median, +3.0 ms
against +4.7; TTFT P90 510 ms against 513 (sglang-router 808). On b nothing moved (its rests are
under 8 KiB): TTFT P90 104 / 104 ms, sglang-router 101.

Measured, side by side in one run (``python bench/precise_routing.py``: 8 simulated pods publishing
KV events, a real Envoy; 30 s of Poisson arrivals per run; 2 shared cores at load average ~10 from
other sessions, so one run's TTFTs move by tens of percent; hit rate as a share of the oracle, an
unlimited cache shared by all; the router's CPU per completed request, the picker's with the pod
that tokenizes for it, or the peer's whole process):

=================  ======================  ======================  ===============  ===============
workload           precise: hit, TTFT P90  approximate (default)   sglang-router    vllm-router
=================  ======================  ======================  ===============  ===============
a shared prefix    100.0%, 52 ms           100.0%, 54 ms           100.0%, 89 ms    99.8%, 163 ms
b multi-turn       98.7%, 123 ms           97.9%, 120 ms           100.0%, 105 ms   100.0%, 182 ms
c no sharing       -, 518 ms               -, 516 ms               -, 822 ms        -, 1,004 ms
p cache pressure   **93.2%**, 397 ms       86.9%, 417 ms           89.8%, 646 ms    91.4%, 3,251 ms
u unseen traffic   **98.5%**, 191 ms       90.0%, 283 ms           78.7%, 449 ms    77.5%, 465 ms
h hot prefix       92.2%, **315 ms**       91.7%, 298 ms           94.2%, 6,012 ms  97.8%, 3,672 ms
=================  ======================  ======================  ===============  ===============

Precise's TTFT P90 against the best peer's: 0.58x (a), 1.17x (b), 0.63x (c), 0.61x (p), 0.42x (u),
0.09x (h). Router CPU per request: precise 7.6-15.4 ms (32.3 on p, whose 256-token answers are 256
streamed events through the picker), approximate 5.7-10.9 (25.3), sglang-router 1.5-2.5 (8.0),
vllm-router 2.8-4.4 (9.6): precise costs 1.7-4.5 ms more than approximate, most of it the
``/tokenize`` round trip (the simulator's tokenizer is no file a picker can load). Where the
designs part: traffic the picker does not see (u), which the events show and the approximate index
cannot; cache pressure (p), where the events say which pod still holds what; and a hot prefix (h),
which the peers' cache-aware policies pile onto one pod (P90 seconds) while the picker's queue and
KV scorers spread it. Without the in-flight bookkeeping (``inFlightTTL``), a second request of a
prefix arriving during the first one's prefill was sent elsewhere: a quick run of a gave precise
91.7% of the oracle against approximate's 100%.

Again on the final tree with the machine otherwise quiet (``python bench/precise_routing.py``, one
run, 1,068 s), hit rate (share of the oracle) and TTFT P90, precise / approximate / sglang-router /
vllm-router: a 100% all, 39 / 34 / 34 / 90 ms; b 98.1 / 97.2 / 100 / 100%, 107 / 110 / 101 / 107 ms;
c 511 / 508 / 793 / 802 ms; p **88.0** / 87.3 / 91.9 / 94.0%, 435 / 377 / 437 / 416 ms; u **97.7** /
87.4 / 78.4 / 75.9%, 270 / 326 / 421 / 453 ms; h 92.2 / 91.6 / 93.3 / 99.2%, 292 / 296 / 5,922 /
3,423 ms. Precise's P90 against the best peer's: 1.14x (a), 1.06x (b), 0.64x (c), 1.05x (p), 0.64x
(u), 0.09x (h). With little queueing, a and b's P90s are tens of milliseconds and precise's
``/tokenize`` hop (~5 ms against approximate) is what separates it from sglang-router. On p both
peers held more of the pool's prefixes than either of this picker's producers, and one LRU cache of
the pool's total size would hit 77.6% (the unlimited oracle, 85.1%, needs an eviction order that
sees the future: Belady's MIN over the same memory reaches it).

Weights. A precise match says what a pod holds, not what it was sent, so it can be trusted further
against the load scorers: with ``prefix-cache-scorer`` weighted 5 instead of the default profile's 3
(queue 2, KV cache 2; ``python bench/precise_routing.py``, whose default that is, one run on a quiet
machine, side by side), precise reached 99.0% of the oracle on u (approximate 88.2%), 91.2% on p
(87.4%; sglang-router 91.8%, vllm-router 94.0%), 98.5% on h and 100% on a and b, and its TTFT P90
against the best peer's was 0.09x (h), 0.15x (u: 65 against 429 ms), 0.64x (c), 0.98x (p), 1.03x
(b), 1.08x (a: 35 against 33 ms, the ``/tokenize`` hop). ``deploy/config/precise-prefix-cache.yaml``
uses these weights.

Local tokenization against the ``/tokenize`` hop. The benchmark's precise picker first had its token
ids from a simulated pod's ``/tokenize`` (the simulator's tokenization was no file a picker could
load); :func:`epp.sim.tokens.write_model_files` now writes it as model files, so the picker tokenizes
locally as it would with a real model mounted. Side by side in one run on a quiet machine (``python
bench/precise_routing.py`` at d0c9e3f, both policies): hit rates within a point of each other
(u 98.7% / 99.1% of the oracle, p 92.0 / 92.6%, h 97.5 / 98.3%), TTFT P90 local / remote 37 / 39 ms
(a), 111 / 109 (b), 523 / 515 (c), 413 / 381 (p), 210 / 257 (u), 321 / 331 (h); the tokenization's
mean time local 1.5-2.8 ms on warm workloads (a, b, p, u) and 8.0 ms on c (every prompt 2-6k new
tokens, HF ``tokenizers`` at ~1.3 µs a token for this vocabulary), remote 2.9-4.5 ms. Against the
peers that run: precise's TTFT P90 0.65x the best peer's on a and c, 0.94x on p, 0.46x on u, 0.09x
on h, and 1.07x on b (111 against sglang-router's 104 ms; the approximate picker 109: on short
multi-turn requests what separates them is the Envoy and ext_proc path, not the routing: all reach
the oracle's hit rate). On p every policy held 91.7-92.8% of the oracle (one LRU cache of the
pool's size: 91.2%).

Per decision. The unlimited oracle asks on p for an eviction order no LRU engine has, so the
benchmark also measures routing alone: each simulated pod answers with what it, and the pod of the
pool holding the most, had cached of the prompt when the request arrived (``x-sim-held-at-arrival``);
the share is the chosen pods' sum over the best pods' (``python bench/precise_routing.py --workloads
p,u --policies default,precise,sglang-router,vllm-router --rounds 2``, at 7c7b554,
medians): on p the pods precise chose held **99.9%** of what the best pods held, approximate's 95.3%,
both peers' 100% (their hit rates 79.1 / 73.9 / 78.1 / 79.7%, 92.9 / 86.9 / 91.8 / 93.7% of the
oracle); on u precise **99.8%**, approximate 87.6%, sglang-router 78.6%, vllm-router 79.9% (99.1 /
88.5 / 79.4 / 79.4% of the oracle). TTFT P90 p 378 / 403 / 437 / 418 ms, u 218 / 356 / 443 / 437 ms.
What the events buy is exactly this: knowing where the blocks still are, where the approximate index
guesses (p: it does not see evictions; u: it does not see the other gateway's traffic).

Tokenizer metrics: ``epp_tokenize_duration_seconds{source}`` (``local`` or ``remote``, every
attempt), ``epp_tokenize_fallbacks_total{reason}`` (requests scored approximately: ``no_tokenizer``,
``unsupported``, ``template_error``, ``timeout``, ``error``, ``status``, ``open``, ``rejected``, and
``no_body``: a request that had a body which did not reach the plugin, logged once a minute too: the
silent failure ``--workers`` had before the body went to the owner),
``epp_tokenize_breaker_open`` (1 while the remote breaker is open), and gauges
``epp_tokenize_reused_tokens`` / ``epp_tokenize_encoded_tokens`` (tokens taken from the prefix cache
/ tokenized), ``epp_tokenize_cache_bytes``, ``epp_tokenize_audit_mismatches``,
``epp_tokenize_after_answer_backlog_bytes`` / ``epp_tokenize_after_answer_dropped`` (see "After the
answer").

Metrics: gauges over the pool ``epp_kv_events`` (events applied), ``epp_kv_event_gaps``,
``epp_kv_event_replays``, ``epp_kv_event_resets``, ``epp_kv_event_decode_errors``,
``epp_kv_event_disconnects``, ``epp_kv_event_pods_tracked`` (pods whose stream is followed without a
hole), ``epp_kv_event_index_blocks``, ``epp_kv_event_lag_seconds`` (the median of the last batches'
publisher-to-index lag), ``epp_kv_event_in_flight_blocks`` / ``epp_kv_event_in_flight_shed`` (blocks
sent that no event has announced yet, and requests whose were dropped from that bounded record: a
count that stays high says the pods announce other keys than this picker computes, see
:class:`_InFlight`); the counter ``epp_kv_event_rejected_total{reason}`` and the histogram
``epp_kv_event_batch_lag_seconds`` (per batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import statistics
import time
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import numpy as np

from epp.framework import (
    PREFIX_MATCH,
    Api,
    Endpoint,
    Handle,
    InferenceRequest,
    LogLimiter,
    PrefixMatch,
    SchedulingResult,
    StateKey,
    check_parameters,
    duration_parameter,
    int_parameter,
    str_parameter,
)
from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvsources import RankDiscovery, RankSource
from epp.prefix.kvsubscriber import KVEventSubscriber, pod_id
from epp.prefix.remote import Breaker, RemoteError, RemoteTokenizer
from epp.prefix.tokenize import (
    DEFAULT_CACHE_BYTES,
    ModelTokenizer,
    Plan,
    TemplateError,
    TokenizerError,
    Unsupported,
)

from .approx_prefix_cache import ApproxPrefixCacheProducer, PrefixParameters

__all__ = [
    "TOKENIZED_PROMPT", "PreciseParameters", "PrecisePrefixCacheProducer", "Tokenizer", "TokenizerParameters",
]  # fmt: skip

log = logging.getLogger(__name__)

Tokenizer = Callable[[InferenceRequest], Sequence[int] | None]

TOKENIZED_PROMPT: StateKey[np.ndarray] = StateKey("tokenized-prompt")
"""The prompt's token ids as the engine computes them (``uint32``), when this producer could tell."""

_OWN = ("kvEventsConfig", "podDiscoveryConfig", "tokenProcessorConfig", "maxBlocksPerPod", "discoverPods",
        "indexerConfig", "inFlightTTL")  # fmt: skip

_PREPARED: StateKey[bool] = StateKey("precise-prefix-cache/prepared")
# The request's keys (in the reference block size) and, per endpoint, the blocks the events said it
# held at scheduling: what pre_request records as in flight on the endpoint picked.
_LOOKUP: StateKey[tuple[list[int], dict[str, int], int]] = StateKey("precise-prefix-cache/lookup")
# Text up to this many bytes is encoded on the event loop: ~3k tokens, ~3 ms (HF tokenizers runs at ~1 µs per
# token here), where a thread hop costs ~0.1 ms; longer text is encoded on the worker threads.
_INLINE_CHARS = 16 << 10
# A rest of at least this many bytes (~64 tokens, ~0.1 ms to encode) may be encoded after the answer (see
# "A warm turn's new text" and "A cold prompt's head"); a shorter one is encoded at once.
_DEFER_CHARS = 256
# A rest put off to after the answer is encoded on the worker threads from this many bytes (~2 ms of
# encoding; the hop costs ~0.15-0.4 ms of CPU), on the event loop below it (see "After the answer").
_THREAD_CHARS = 8 << 10
# At most this much text waits for those threads; a rest beyond it is not encoded (counted): its pick is made,
# and past a backlog its blocks would reach the in-flight record after the prefill that stores them.
_BACKLOG_CHARS = 64 << 20
# What is left of a prompt to encode after the answer: its plan, known start (or head) and tokenizer.
_DEFERRED: StateKey[_Deferred] = StateKey("precise-prefix-cache/deferred")
_TOKENIZED_APIS = {Api.COMPLETIONS: "completions", Api.CHAT_COMPLETIONS: "chat_completions"}


class _InFlight:
    """Blocks a pod is computing for requests this picker sent it, until its events announce them.

    A pod publishes a block when it has computed it (vLLM: at the end of the engine step), so for the
    length of a prefill the events cannot know what a request just sent there will leave in the cache;
    a second request of the same prefix arriving meanwhile would be sent elsewhere and pay the prefix
    again. So the blocks a request will add (those past what the events say the picked pod holds) are
    recorded here for that pod, and dropped as soon as the pod's events store them (``confirm``), or
    after ``ttl`` seconds if they never do (the request failed, or never reached the pod).

    Bounded: beyond ``max_keys`` blocks the oldest requests' are dropped first (``shed`` counts them). A
    record that stays large is a symptom: blocks no event confirms are blocks the pods never announce
    with these keys (a tokenizer that is not the served model's, a block size or hash seed that differs):
    at 260 requests a second of 5k-token prompts such a record held 840k blocks (~200 MB) for its TTL
    (``python bench/soak.py --precise``, with prompts the tokenizer files did not know).
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic, max_keys: int = 1 << 20) -> None:
        self.ttl = ttl
        self.max_keys = max_keys
        self.shed = 0
        self._clock = clock
        self._where: dict[int, dict[str, float]] = {}  # key -> endpoint name -> expiry
        # In expiry order (one ttl). The keys as 8-byte words: a request's stay here for the TTL, confirmed
        # or not, and as a list of ints they were ~5x the size (48 against 9.5 MiB for 7,300 requests of 150
        # blocks, a 30 s TTL at 240 req/s: ``bench/soak.py --precise``'s rate).
        self._queue: deque[tuple[float, str, array[int]]] = deque()

    def add(self, name: str, keys: list[int]) -> None:
        if not keys or self.ttl <= 0:
            return
        expiry = self._clock() + self.ttl
        where = self._where
        for key in keys:
            holders = where.get(key)
            if holders is None:
                where[key] = {name: expiry}
            else:
                holders[name] = expiry
        self._queue.append((expiry, name, array("Q", keys)))
        while len(where) > self.max_keys and len(self._queue) > 1:
            self._drop(*self._queue.popleft())
            self.shed += 1

    def _drop(self, expiry: float, name: str, keys: array[int]) -> None:
        where = self._where
        for key in keys:
            holders = where.get(key)
            if holders is not None and holders.get(name) == expiry:
                del holders[name]
                if not holders:
                    del where[key]

    def confirm(self, name: str, keys: list[int]) -> None:
        where = self._where
        for key in keys:
            holders = where.get(key)
            if holders is not None and holders.pop(name, None) is not None and not holders:
                del where[key]

    def prune(self) -> None:
        now = self._clock()
        queue = self._queue
        while queue and queue[0][0] <= now:
            self._drop(*queue.popleft())

    def holders(self, key: int) -> Mapping[str, float]:
        return self._where.get(key) or {}

    def __len__(self) -> int:
        return len(self._where)


class TokenizerParameters:
    """``indexerConfig.tokenizersPoolConfig`` (see the module docstring); errors name the key."""

    def __init__(self, name: str, parameters: Mapping[str, Any]) -> None:
        where = f"{name}: indexerConfig"
        indexer = parameters.get("indexerConfig") or {}
        if not isinstance(indexer, Mapping):
            raise ValueError(f"{where} must be a mapping, got {indexer!r}")
        check_parameters(where, indexer, ("tokenizersPoolConfig",))
        pool = indexer.get("tokenizersPoolConfig") or {}
        where = f"{where}.tokenizersPoolConfig"
        if not isinstance(pool, Mapping):
            raise ValueError(f"{where} must be a mapping, got {pool!r}")
        check_parameters(where, pool, ("modelName", "workersCount", "local", "hf", "uds", "minPrefixOverlapRatio",
                                       "chatTemplate", "prefixCacheBytes", "timeout", "remote"))  # fmt: skip
        self.model_name = str_parameter(where, pool, "modelName", "", allow_empty=True)
        self.workers = int_parameter(where, pool, "workersCount", 2, minimum=1)
        hf = pool.get("hf")
        if hf is not None and not (isinstance(hf, Mapping) and hf.get("enabled") is False):
            raise ValueError(f"{where}: hf must be null or {{enabled: false}}: tokenizers are never downloaded here; "
                             "give the model's files with local")  # fmt: skip
        if pool.get("uds") is not None:
            raise ValueError(f"{where}: uds (llm-d's tokenizer sidecar) is not supported; use local files, "
                             "or remote (the engine's /tokenize)")  # fmt: skip
        ratio = pool.get("minPrefixOverlapRatio", 0.8)
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 <= ratio <= 1:
            raise ValueError(f"{where}: minPrefixOverlapRatio must be a number in [0, 1], got {ratio!r}")
        local = pool.get("local") or {}
        if not isinstance(local, Mapping):
            raise ValueError(f"{where}.local must be a mapping, got {local!r}")
        check_parameters(f"{where}.local", local, ("autoDiscoveryDir", "autoDiscoveryTokenizerFileName",
                                                   "modelTokenizerMap"))  # fmt: skip
        default_dir = os.environ.get("LOCAL_TOKENIZER_DIR", "/mnt/models")
        self.discovery_dir = str_parameter(f"{where}.local", local, "autoDiscoveryDir", default_dir)
        self.file_name = str_parameter(f"{where}.local", local, "autoDiscoveryTokenizerFileName", "tokenizer.json")
        mapping = local.get("modelTokenizerMap") or {}
        if not isinstance(mapping, Mapping) or not all(isinstance(v, str) for v in mapping.values()):
            raise ValueError(f"{where}.local.modelTokenizerMap must map model names to paths, got {mapping!r}")
        self.model_map: dict[str, str] = dict(mapping)
        template = pool.get("chatTemplate")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{where}: chatTemplate must be a string (a file or a template), got {template!r}")
        self.chat_template: str | None = template
        self.cache_bytes = int_parameter(where, pool, "prefixCacheBytes", DEFAULT_CACHE_BYTES, minimum=0)
        self.timeout = duration_parameter(where, pool, "timeout", 0.5, positive=True)
        remote = pool.get("remote") or {}
        if not isinstance(remote, Mapping):
            raise ValueError(f"{where}.remote must be a mapping, got {remote!r}")
        rwhere = f"{where}.remote"
        check_parameters(rwhere, remote, ("mode", "url", "timeout", "failureThreshold", "cooldown"))
        self.remote_mode = str_parameter(rwhere, remote, "mode", "tokenize")
        if self.remote_mode not in ("tokenize", "render", "none"):
            raise ValueError(f"{rwhere}: mode must be tokenize, render or none, got {self.remote_mode!r}")
        self.remote_url = str_parameter(rwhere, remote, "url", "", allow_empty=True).rstrip("/")
        if self.remote_url and not self.remote_url.startswith(("http://", "https://")):
            raise ValueError(f"{rwhere}: url must start with http:// or https://, got {self.remote_url!r}")
        self.remote_timeout = duration_parameter(rwhere, remote, "timeout", 0.25, positive=True)
        self.failure_threshold = int_parameter(rwhere, remote, "failureThreshold", 5, minimum=1)
        self.cooldown = duration_parameter(rwhere, remote, "cooldown", 5.0, positive=True)

    def tokenizer_files(self) -> dict[str, Path]:
        """Model name -> its tokenizer.json ("" for ``modelName``'s), for those found."""
        found: dict[str, Path] = {}
        for model, path in self.model_map.items():
            file = Path(path)
            found[model] = file / self.file_name if file.is_dir() else file
        root = Path(self.discovery_dir)
        for directory in ([root / self.model_name] if self.model_name else []) + [root]:
            if (directory / self.file_name).is_file():
                found[""] = directory / self.file_name
                break
        return found


class _Deferred:
    """A prompt whose known start (a reused prefix, or a cold prompt's head) is looked up before the rest
    is encoded (see "A warm turn's new text" and "A cold prompt's head")."""

    __slots__ = ("decided", "plan", "tokenizer")

    def __init__(self, plan: Plan, tokenizer: ModelTokenizer, decided: bool = False) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.decided = decided  # prepare_data found that the known start decides (a rest too long for the loop)

    @property
    def known(self) -> np.ndarray:
        assert self.plan.known is not None
        return self.plan.known


class _Tokenization:
    """The producer's tokenizers (local files, else the engine), their thread pool and metrics."""

    def __init__(self, name: str, p: TokenizerParameters, handle: Handle | None) -> None:
        self.p = p
        self.handle = handle
        self.local: dict[str, ModelTokenizer] = {}
        for model, file in p.tokenizer_files().items():
            try:
                self.local[model] = ModelTokenizer.from_dir(
                    file.parent, chat_template=p.chat_template, name=model or p.model_name,
                    cache_bytes=p.cache_bytes, tokenizer_file=file.name,
                )  # fmt: skip
            except TokenizerError as exc:
                raise ValueError(f"{name}: indexerConfig.tokenizersPoolConfig: {exc}") from exc
        self._executor: ThreadPoolExecutor | None = None
        self._after: ThreadPoolExecutor | None = None  # finish_later's own: never ahead of a pick's encoding
        self._pending: set[asyncio.Future[None]] = set()  # finish_later's, until recorded on the loop
        self.backlog = 0  # bytes of text handed to finish_later's threads, not encoded yet (the loop's count)
        self.dropped = 0  # rests not encoded: the backlog was full
        self._turn = itertools.count()
        # A warm turn's new text may wait for the answer once startup has said that no other plugin reads the
        # ids while scheduling (PrecisePrefixCacheProducer.data_consumed); until then it never does.
        self.defer = False
        observe_remote: Callable[[float], None] | None = None
        self._observe_local: Callable[[float], None] | None = None
        self._fallback: Callable[[str], None] = lambda reason: None
        self._no_body_log = LogLimiter(60.0)
        if handle is not None:
            m = handle.metrics
            duration = m.histogram(
                "epp_tokenize_duration_seconds", "Time to a prompt's token ids, per attempt.", ("source",),
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            )  # fmt: skip
            observe_remote = duration.labels("remote").observe
            self._observe_local = duration.labels("local").observe
            fallbacks = m.counter("epp_tokenize_fallbacks", "Requests scored by the approximate index for want of "
                                  "token ids, by reason.", ("reason",))  # fmt: skip
            self._fallback = lambda reason: fallbacks.labels(reason).inc()
            self._export(handle)
        self.remote: RemoteTokenizer | None = None
        if p.remote_mode != "none":
            self.remote = RemoteTokenizer(
                mode=p.remote_mode, timeout=p.remote_timeout,
                breaker=Breaker(p.failure_threshold, p.cooldown), observe=observe_remote,
            )  # fmt: skip

    def _export(self, handle: Handle) -> None:
        def total(attr: str) -> Callable[[], float]:
            return lambda: float(sum(getattr(t.stats(), attr) for t in self.local.values()))

        m = handle.metrics
        m.gauge_sum("epp_tokenize_reused_tokens", "Prompt tokens taken from the tokenizer's prefix cache.",
                    total("reused_tokens"))  # fmt: skip
        m.gauge_sum("epp_tokenize_encoded_tokens", "Prompt tokens the local tokenizer computed.",
                    total("encoded_tokens"))  # fmt: skip
        m.gauge_sum("epp_tokenize_cache_bytes", "Bytes held by the tokenizer's prefix cache.", total("cache_bytes"))
        m.gauge_sum("epp_tokenize_audit_mismatches", "Reused prefixes that differed from a whole tokenization.",
                    total("audit_mismatches"))  # fmt: skip
        m.gauge_sum("epp_tokenize_after_answer_backlog_bytes", "Text of prompts put off to after the answer that "
                    "waits for the tokenizer's threads.", lambda: float(self.backlog))  # fmt: skip
        m.gauge_sum("epp_tokenize_after_answer_dropped", "Prompts whose rest was not encoded after the answer: the "
                    "backlog was full.", lambda: float(self.dropped))  # fmt: skip
        m.gauge_sum("epp_tokenize_breaker_open", "1 while the remote tokenizer's circuit breaker is open.",
                    lambda: float(self.remote is not None and self.remote.breaker.state == "open"))  # fmt: skip

    def tokenizer_for(self, model: str) -> ModelTokenizer | None:
        found = self.local.get(model)
        return found if found is not None else self.local.get("")

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.p.workers, thread_name_prefix="epp-tokenize")
        return self._executor

    def tokenize_inline(self, request: InferenceRequest) -> np.ndarray | None:
        """Local tokenization on the calling thread (``produce`` without ``prepare_data``)."""
        api = _TOKENIZED_APIS.get(request.api)
        tokenizer = self.tokenizer_for(request.model)
        if api is None or tokenizer is None or not self._has_body(request):
            return None
        return self._local(tokenizer, api, request.body)

    def _has_body(self, request: InferenceRequest) -> bool:
        """Whether the request's body is here to tokenize. One it had and this plugin did not get (it routes
        approximately) is counted, and said."""
        if request.body:
            return True
        if not request.body_size:
            return False
        self._fallback("no_body")
        held = self._no_body_log.allow()
        if held is not None:
            log.warning(
                "request %s had a body of %d bytes, which did not reach this plugin: scored by the approximate "
                "index (a process that routes without the request's body%s)",
                request.request_id or "?",
                request.body_size,
                f"; {held} more such requests in the last minute" if held else "",
            )
        return False

    def _local(self, tokenizer: ModelTokenizer, api: str, body: bytes) -> np.ndarray | None:
        try:
            return tokenizer.request_ids(api, body)
        except Unsupported:
            self._fallback("unsupported")
        except TemplateError:
            self._fallback("template_error")
        return None

    async def prepare(
        self, request: InferenceRequest, known_decides: Callable[[Plan], bool]
    ) -> np.ndarray | _Deferred | None:
        """The request's ids, or a :class:`_Deferred` (its known start; the rest to encode after the answer).
        ``known_decides(plan)``: whether a rest too long to encode on the loop may wait (see "After the
        answer")."""
        api = _TOKENIZED_APIS.get(request.api)
        if api is None or not self._has_body(request):
            return None
        tokenizer = self.tokenizer_for(request.model)
        if tokenizer is not None:
            return await self._prepare_local(tokenizer, api, request.body, known_decides)
        if self.remote is None:
            self._fallback("no_tokenizer")
            return None
        url = self.p.remote_url or self._pick_pod()
        if url is None:
            self._fallback("no_tokenizer")
            return None
        try:
            return await self.remote.token_ids(url, api, request.body)
        except RemoteError as exc:
            self._fallback(exc.reason)
            log.debug("remote tokenization failed (%s): %s", exc.reason, exc)
            return None

    def _pick_pod(self) -> str | None:
        endpoints = self.handle.pool.endpoints() if self.handle is not None else ()
        if not endpoints:
            return None
        return f"http://{endpoints[next(self._turn) % len(endpoints)].hostport}"

    async def _prepare_local(
        self, tokenizer: ModelTokenizer, api: str, body: bytes, known_decides: Callable[[Plan], bool]
    ) -> np.ndarray | _Deferred | None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            try:
                plan = tokenizer.plan(api, body)  # decoding, rendering, the prefix cache: on the loop
                if self.defer and plan.known is not None and plan.pending >= _DEFER_CHARS:
                    if plan.pending <= _INLINE_CHARS:
                        return _Deferred(plan, tokenizer)  # produce decides, and encodes at once if need be
                    if known_decides(plan):  # decided here: produce never encodes this much on the loop
                        return _Deferred(plan, tokenizer, decided=True)
                if plan.pending <= _INLINE_CHARS:
                    return plan.finish()
                future = loop.run_in_executor(self._pool(), plan.finish)
                try:
                    return await asyncio.wait_for(asyncio.shield(future), self.p.timeout)
                except TimeoutError:
                    self._fallback("timeout")  # the thread goes on: the next turn finds its prefix cached
                    future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved, not logged
                    return None
            except Unsupported:
                self._fallback("unsupported")
            except TemplateError:
                self._fallback("template_error")
            return None
        finally:
            if self._observe_local is not None:
                self._observe_local(loop.time() - started)
            self._audit(tokenizer)

    def _audit(self, tokenizer: ModelTokenizer) -> None:
        """Hand a due audit (a warm result checked against a whole tokenization) to the threads."""
        due = tokenizer.pop_audit()
        if due is not None:
            self._pool().submit(tokenizer.audit, *due)

    def finish(self, deferred: _Deferred) -> np.ndarray | None:
        """The ids of a deferred prompt, its rest encoded now (on the calling thread)."""
        try:
            return deferred.plan.finish()
        except Unsupported:
            self._fallback("unsupported")
            return None
        finally:
            self._audit(deferred.tokenizer)

    def finish_later(self, deferred: _Deferred, done: Callable[[np.ndarray], None]) -> None:
        """:meth:`finish` on threads of its own (a backlog of these never delays an encoding a pick
        awaits); ``done(ids)`` is then called on the event loop. Beyond :data:`_BACKLOG_CHARS` of text
        waiting, nothing is encoded (``dropped``)."""
        size = deferred.plan.pending
        if self.backlog + size > _BACKLOG_CHARS:
            self.dropped += 1
            return
        loop = asyncio.get_running_loop()
        settled = loop.create_future()
        self._pending.add(settled)
        self.backlog += size

        def on_loop(ids: np.ndarray | None) -> None:
            self._pending.discard(settled)
            self.backlog -= size
            try:
                if ids is not None:
                    done(ids)
            except Exception:
                log.exception("the ids of a prompt encoded after the answer could not be recorded")
            finally:
                settled.set_result(None)

        def hand_back(future: Future[np.ndarray | None]) -> None:
            ids = None
            if not future.cancelled():  # (cancelled: the producer closed)
                if future.exception() is not None:
                    log.error("encoding a prompt after the answer failed", exc_info=future.exception())
                else:
                    ids = future.result()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is left to record it for
                loop.call_soon_threadsafe(on_loop, ids)

        if self._after is None:
            self._after = ThreadPoolExecutor(self.p.workers, thread_name_prefix="epp-tokenize-after")
            self._pool()  # made here, on the loop: finish hands a due audit to it from those threads
        self._after.submit(self.finish, deferred).add_done_callback(hand_back)

    def pending_count(self) -> int:
        """Prompts put off to the worker threads whose ids are not recorded yet."""
        return len(self._pending)

    async def settled(self) -> None:
        """Until the prompts put off to the worker threads (:meth:`finish_later`) are recorded."""
        while self._pending:
            await asyncio.gather(*self._pending)

    async def close(self) -> None:
        if self.remote is not None:
            await self.remote.close()
        for executor in (self._executor, self._after):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._after = None


class PreciseParameters:
    def __init__(self, name: str, parameters: Mapping[str, Any]) -> None:
        def section(key: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
            value = parameters.get(key) or {}
            if not isinstance(value, Mapping):
                raise ValueError(f"{name}: {key} must be a mapping, got {value!r}")
            check_parameters(f"{name}: {key}", value, allowed)
            return value

        def integer(where: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
            value = where.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}: {key} must be an integer ≥ {minimum}, got {value!r}")
            return value

        events = section("kvEventsConfig", ("zmqEndpoint", "topicFilter", "concurrency", "discoverPods",
                                            "podDiscoveryConfig"))  # fmt: skip
        discovery_keys = ("socketPort", "podLabelSelector", "podNamespace")
        discovery = section("podDiscoveryConfig", discovery_keys)
        nested = events.get("podDiscoveryConfig") or {}
        if not isinstance(nested, Mapping):
            raise ValueError(f"{name}: kvEventsConfig.podDiscoveryConfig must be a mapping, got {nested!r}")
        check_parameters(f"{name}: kvEventsConfig.podDiscoveryConfig", nested, discovery_keys)
        discovery = {**discovery, **nested}
        tokens = section("tokenProcessorConfig", ("blockSize", "hashSeed"))
        self.bind: str | None = events.get("zmqEndpoint") or None
        self.topic_filter = str(events.get("topicFilter", "kv@"))
        if self.bind is not None and not isinstance(self.bind, str):
            raise ValueError(f"{name}: kvEventsConfig.zmqEndpoint must be a string, got {self.bind!r}")
        self.socket_port = integer(discovery, "socketPort", 5557, 1)
        self.block_size = integer(tokens, "blockSize", 16, 1)
        self.hash_seed = integer(tokens, "hashSeed", 0, 0)
        self.max_blocks_per_pod = integer(parameters, "maxBlocksPerPod", 1 << 20, 1)
        self.in_flight_ttl = duration_parameter(name, parameters, "inFlightTTL", 30.0)
        self.tokenizer = TokenizerParameters(name, parameters)
        self.approximate = PrefixParameters.parse(name, {k: v for k, v in parameters.items() if k not in _OWN})


def _host(endpoint: Endpoint) -> str:
    """The endpoint's address as a URL's host (an IPv6 one in brackets)."""
    return f"[{endpoint.address}]" if ":" in endpoint.address else endpoint.address


class PrecisePrefixCacheProducer:
    produces = (PREFIX_MATCH, TOKENIZED_PROMPT)
    reads_body = True  # it renders and tokenizes the request as received (with --workers: sent to the owner)

    def __init__(
        self,
        name: str = "precise-prefix-cache-producer",
        parameters: PreciseParameters | None = None,
        handle: Handle | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.name = name
        self.parameters = p = parameters or PreciseParameters(name, {})
        self.tokenizer = tokenizer
        # The model's own tokenizer (local files, else the engine), unless a callable replaces it.
        self.tokenization = _Tokenization(name, p.tokenizer, handle) if tokenizer is None else None
        self.approximate = ApproxPrefixCacheProducer(f"{name}/approximate", p.approximate, handle)
        self.in_flight = _InFlight(p.in_flight_ttl)
        self.index = KVEventIndex(seed=p.hash_seed, max_blocks_per_pod=p.max_blocks_per_pod, on_store=self._stored)
        self.subscriber: KVEventSubscriber | None = None
        self._names: dict[str, str] = {}  # index pod id (an endpoint's hostport) -> endpoint name
        self._pods_by_name: dict[str, str] = {}  # endpoint name -> index pod id
        self._endpoints: dict[str, Endpoint] = {}  # hostport -> endpoint
        self._discovery: RankDiscovery | None = None  # each server's data-parallel ranks (epp.prefix.kvsources)
        self._rank_streams: dict[str, list[str]] = {}  # connect mode: hostport -> the ranks' streams added
        self._on_reject: Callable[[str], None] | None = None
        self._on_lag: Callable[[float], None] | None = None
        self.deferred = 0  # prompts looked up by their known start, the rest encoded after the answer
        self.head_mismatches = 0  # cold prompts whose head's ids were not the start of their whole ids
        if handle is not None:
            self._export(handle)
            handle.pool.subscribe(self._pool_changed)
            self._pool_changed(tuple(handle.pool.endpoints()), ())

    @classmethod
    def from_config(cls, name: str, parameters: Mapping[str, Any], handle: Handle) -> Self:
        return cls(name, PreciseParameters(name, parameters), handle)

    def data_consumed(self, names: frozenset[str]) -> None:
        """Another plugin reading the token ids (declared ``consumes``) gets them before the pick, always."""
        if self.tokenization is not None:
            self.tokenization.defer = TOKENIZED_PROMPT.name not in names

    def _export(self, handle: Handle) -> None:
        def stat(attr: str) -> Callable[[], float]:
            return lambda: float(getattr(self.subscriber.stats, attr)) if self.subscriber else 0.0

        m = handle.metrics
        m.gauge_sum("epp_kv_events", "KV-cache events applied to the precise prefix index.", stat("events"))
        m.gauge_sum("epp_kv_event_gaps", "Holes in pods' KV-event sequence numbers.", stat("gaps"))
        m.gauge_sum("epp_kv_event_replays", "KV-event holes filled from a replay endpoint.", stat("replays"))
        m.gauge_sum("epp_kv_event_resets", "KV-event publisher restarts (seq back to 0).", stat("resets"))
        m.gauge_sum("epp_kv_event_decode_errors", "KV-event messages that did not decode.", stat("decode_errors"))
        m.gauge_sum("epp_kv_event_disconnects", "KV-event publishers' connections lost.", stat("disconnects"))
        m.gauge_sum("epp_kv_event_pods_tracked", "Pods whose KV-event stream is followed without a hole.",
                    lambda: sum(1 for pod in self.index.pods() if self.index.known(pod)))  # fmt: skip
        blocks = "Blocks in the precise prefix index."
        m.gauge_sum("epp_kv_event_index_blocks", blocks, lambda: self.index.stats().blocks)
        m.gauge_sum("epp_kv_event_lag_seconds", "Median publisher-to-index lag of recent batches.", self._lag)
        rejected = m.counter("epp_kv_event_rejected", "KV-event messages dropped, or applied but flagged "
                             "(identity), because the pool does not confirm whose they are; by reason.", ("reason",))
        self._on_reject = lambda reason: rejected.labels(reason).inc()
        lag = m.histogram("epp_kv_event_batch_lag_seconds", "From a KV-event batch's publication to its application.",
                          buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0))  # fmt: skip
        self._on_lag = lag.observe
        m.gauge_sum("epp_kv_event_in_flight_blocks", "Blocks sent to pods that their events have not announced "
                    "yet.", lambda: float(len(self.in_flight)))  # fmt: skip
        m.gauge_sum("epp_kv_event_in_flight_shed", "Requests whose in-flight blocks were dropped before their TTL: "
                    "the record was full.", lambda: float(self.in_flight.shed))  # fmt: skip
        m.gauge_sum("epp_tokenize_deferred_requests", "Prompts looked up by their reused start or head, the rest "
                    "encoded after the answer.", lambda: float(self.deferred))  # fmt: skip
        m.gauge_sum("epp_tokenize_head_mismatches", "Cold prompts whose head, encoded alone, did not start their "
                    "ids.", lambda: float(self.head_mismatches))  # fmt: skip

    def _stored(self, pod: str, keys: list[int]) -> None:
        name = self._names.get(pod.split("@", 1)[0])
        if name is not None:
            self.in_flight.confirm(name, keys)

    def _lag(self) -> float:
        lags = self.subscriber.stats.lags if self.subscriber else ()
        return statistics.median(lags) if lags else 0.0

    def _ensure_subscriber(self) -> KVEventSubscriber | None:
        if self.subscriber is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return None  # built before the loop runs: the first pool change or request on it starts it
            p = self.parameters
            self.subscriber = KVEventSubscriber(self.index, topic_filter=p.topic_filter, bind=p.bind,
                                                on_reject=self._on_reject, on_lag=self._on_lag)  # fmt: skip
            self.subscriber.start()
            for endpoint in self._endpoints.values():
                self._follow(endpoint)
        return self.subscriber

    def publisher_of(self, endpoint: Endpoint) -> tuple[str, str | None]:
        """Where ``endpoint``'s KV events are followed: its publisher, and its replay socket (or None)."""
        host = _host(endpoint)
        replay = f"tcp://{host}:{endpoint.kv_replay_port}" if endpoint.kv_replay_port else None
        return f"tcp://{host}:{self._events_port(endpoint)}", replay

    def _events_port(self, endpoint: Endpoint) -> int:
        """The port of ``endpoint``'s publisher as the pool names it (else ``socketPort``)."""
        return endpoint.kv_events_port or self.parameters.socket_port

    def _follow(self, endpoint: Endpoint) -> None:
        subscriber = self.subscriber
        if subscriber is None:
            return
        if self.parameters.bind is not None:
            pod_name = endpoint.name.rsplit("-rank-", 1)[0]  # Kubernetes endpoints are <pod>-rank-<i>
            subscriber.allow(endpoint.hostport, (endpoint.name, pod_name), self.publisher_of(endpoint)[1])
            log.info("KV events: accepting %s (%s) on %s", endpoint.name, endpoint.hostport, subscriber.bound_endpoint)
        else:
            publisher, replay = self.publisher_of(endpoint)
            subscriber.follow(pod_id(endpoint.hostport), publisher, replay, address=endpoint.hostport)
        if self._discovery is None:
            self._discovery = RankDiscovery(self._ranks_found)
        self._discovery.watch(endpoint.hostport, f"http://{endpoint.hostport}")

    def _ranks_found(self, hostport: str, sources: list[RankSource]) -> None:
        """A server's ranks (:mod:`epp.prefix.kvsources`): follow those whose publisher is not the one
        the pool names; binding, bind a port for each."""
        endpoint, subscriber = self._endpoints.get(hostport), self.subscriber
        if endpoint is None or subscriber is None:
            return
        if self.parameters.bind is not None:
            ranks = sources[-1].rank + 1
            if ranks > 1:
                log.info("KV events: %s (%s) reports %d data-parallel ranks", endpoint.name, hostport, ranks)
            subscriber.expect_ranks(ranks)
            return
        own = self._events_port(endpoint)
        host = _host(endpoint)
        for source in sources:
            if source.port is None or source.port == own:
                continue
            pod = pod_id(hostport, source.rank)
            if source.rank == 0:
                log.warning("KV events: %s (%s) says its rank 0 publishes on port %d, the pool says %d; "
                            "following the pool's", endpoint.name, hostport, source.port, own)  # fmt: skip
                continue
            replay = f"tcp://{host}:{source.replay_port}" if source.replay_port else None
            subscriber.follow(pod, f"tcp://{host}:{source.port}", replay, address=hostport)
            self._rank_streams.setdefault(hostport, []).append(pod)

    def _forget(self, endpoint: Endpoint) -> None:
        subscriber = self.subscriber
        pod = pod_id(endpoint.hostport)
        if self._discovery is not None:
            self._discovery.cancel(endpoint.hostport)
        for stream in self._rank_streams.pop(endpoint.hostport, ()):
            if subscriber is not None:
                subscriber.unfollow(stream)
        if subscriber is None:
            self.index.remove_pod(pod)
        elif self.parameters.bind is not None:
            subscriber.disallow(endpoint.hostport)
            for known in self.index.pods():  # the endpoint's streams, every rank
                if known == pod or known.startswith(pod + "@"):
                    subscriber.forget(known)
        else:
            subscriber.unfollow(pod)

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        for endpoint in removed:
            old = self._endpoints.get(endpoint.hostport)
            if old == endpoint:
                del self._endpoints[endpoint.hostport]
                self._names.pop(pod_id(endpoint.hostport), None)
                self._pods_by_name.pop(endpoint.name, None)
                self._forget(endpoint)
        for endpoint in added:
            old = self._endpoints.get(endpoint.hostport)
            if old is not None and self.publisher_of(old) != self.publisher_of(endpoint):
                self._forget(old)  # the same address, its publisher elsewhere now: follow it there
            self._endpoints[endpoint.hostport] = endpoint
            self._names[pod_id(endpoint.hostport)] = endpoint.name
            self._pods_by_name[endpoint.name] = pod_id(endpoint.hostport)
        if self._ensure_subscriber() is not None:
            for endpoint in added:
                self._follow(endpoint)

    async def prepare_data(self, request: InferenceRequest) -> None:
        """The prompt's token ids into ``request.state[TOKENIZED_PROMPT]`` (see "Tokenization")."""
        if self.tokenization is None:
            return
        request.state[_PREPARED] = True
        ids = await self.tokenization.prepare(request, lambda plan: self._known_decides(request, plan))
        if isinstance(ids, _Deferred):
            request.state[_DEFERRED] = ids
        elif ids is not None:
            request.state[TOKENIZED_PROMPT] = ids

    def _token_ids(self, request: InferenceRequest) -> Sequence[int] | np.ndarray | None:
        if self.tokenizer is not None:
            return self.tokenizer(request)
        ids = request.state.get(TOKENIZED_PROMPT)
        if ids is None and self.tokenization is not None and _PREPARED not in request.state:
            ids = self.tokenization.tokenize_inline(request)  # no prepare_data ran (a bare scheduler)
            if ids is not None:
                request.state[TOKENIZED_PROMPT] = ids
        return ids

    def produce(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None:
        self._ensure_subscriber()
        token_ids = self._token_ids(request)
        deferred = request.state.get(_DEFERRED) if token_ids is None else None
        approx: PrefixMatch | None = None
        covered = self._covered()
        if (deferred is None and (token_ids is None or not len(token_ids))) or not all(
            endpoint.name in covered for endpoint in candidates
        ):
            self.approximate.produce(request, candidates)  # (see "Pods without events")
            approx = request.state.get(PREFIX_MATCH)
            if approx is not None and covered:  # pods the events cover take the precise match only
                approx = PrefixMatch(approx.blocks, {n: b for n, b in approx.matched.items() if n not in covered},
                                     approx.block_tokens)  # fmt: skip
        if deferred is not None:
            keys, matched, precise, block_size, blocks = self._lookup(
                request, deferred.known, deferred.plan.estimated, approx
            )
            # (decided: never encoded here, even should the index's block sizes have changed since, leaving no key)
            if deferred.decided or (keys and not self._rest_matters(deferred.plan, keys, matched)):
                self.deferred += 1
                request.state[_LOOKUP] = (keys, precise, block_size)
                request.state[PREFIX_MATCH] = PrefixMatch(blocks, matched, block_size)
                return
            del request.state[_DEFERRED]  # the rest may tell the holders apart: encoded before the pick
            token_ids = self._finish(request, deferred)
        if token_ids is None or not len(token_ids):
            if approx is None:  # (left out for ids that then failed to encode)
                self.approximate.produce(request, candidates)
            return  # the approximate match stands for every pod
        keys, matched, precise, block_size, blocks = self._lookup(request, token_ids, len(token_ids), approx)
        request.state[_LOOKUP] = (keys, precise, block_size)
        request.state[PREFIX_MATCH] = PrefixMatch(blocks, matched, block_size)

    @staticmethod
    def _rest_matters(plan: Plan, keys: list[int], matched: Mapping[str, int]) -> bool:
        """Whether the rest of a prompt (``plan``'s, past its known start, whose ``keys`` gave ``matched``)
        could change which pod the lookup favours, so that it must be encoded before the pick."""
        if plan.head:  # nobody holds its first block: nobody holds any (see "A cold prompt's head")
            return any(run > 0 for run in matched.values())
        # A pod's match runs into the rest only if it holds all the known start (see "A warm turn's new text").
        return sum(1 for run in matched.values() if run >= len(keys)) >= 2

    def _known_decides(self, request: InferenceRequest, plan: Plan) -> bool:
        """For a rest too long to encode on the loop: whether it may wait for the answer, asked before the
        candidates are known, so of every pool endpoint (all followed by their events, else no)."""
        covered = self._covered()
        if not all(name in covered for name in self._pods_by_name):
            return False  # the approximate match of a pod without events would need the whole ids
        assert plan.known is not None
        keys, matched, *_ = self._lookup(request, plan.known, plan.estimated, None)
        return bool(keys) and not self._rest_matters(plan, keys, matched)

    def _finish(self, request: InferenceRequest, deferred: _Deferred) -> np.ndarray | None:
        assert self.tokenization is not None
        ids = self.tokenization.finish(deferred)
        if ids is not None:
            request.state[TOKENIZED_PROMPT] = ids
        return ids

    def _keys(
        self, request: InferenceRequest, token_ids: Sequence[int] | np.ndarray, size: int, known: Sequence[int] = ()
    ) -> list[int]:
        p = self.parameters
        return chain_keys(token_ids, size, p.hash_seed, max(1, p.approximate.max_prefix_tokens // size),
                          lora_name=request.adapter or None, cache_salt=request.cache_salt or None,
                          known=known)  # fmt: skip

    def _covered(self) -> set[str]:
        """The endpoints whose events are followed without a hole (a DP rank's stream counts for its
        endpoint): for them the approximate index has nothing to say."""
        index, names = self.index, self._names
        return {names.get(pod.split("@", 1)[0], pod) for pod in index.pods() if index.known(pod)}

    def _lookup(
        self, request: InferenceRequest, token_ids: Sequence[int] | np.ndarray, tokens: int, approx: PrefixMatch | None
    ) -> tuple[list[int], dict[str, int], dict[str, int], int, int]:
        """The request's keys in the reference block size, each endpoint's match (in those blocks), the
        matches the events gave, that block size, and the prompt's blocks in it. ``tokens``: the prompt's
        length (``token_ids`` may be its start: then the keys are fewer than its blocks), to which
        ``approx``, the approximate matches of the pods whose events are not followed (None when every
        candidate's are), is scaled."""
        p = self.parameters
        sizes = sorted(self.index.block_sizes()) or [p.block_size]
        block_size = sizes[0]
        blocks = 0
        matched: dict[str, int] = {}
        precise: dict[str, int] = {}
        keys: list[int] = []
        for size in sizes:  # pods of different engines may use different block sizes
            size_keys = self._keys(request, token_ids, size)
            if size == block_size:
                keys = size_keys
                blocks = max(len(keys), min(tokens, p.approximate.max_prefix_tokens) // block_size)
                if approx is not None and keys:
                    for name in approx.matched:  # pods the events do not cover keep the approximate match
                        matched[name] = int(approx.share(name) * blocks)
            for pod, (_, weighted) in self.index.match(size_keys).items():
                name = self._names.get(pod.split("@", 1)[0], pod)  # a DP rank's stream counts for its endpoint
                run = int(weighted * size / block_size + 1e-9)
                if run > matched.get(name, 0):
                    matched[name] = precise[name] = run
        self._add_in_flight(keys, matched)
        return keys, matched, precise, block_size, blocks

    def _add_in_flight(self, keys: list[int], matched: dict[str, int]) -> None:
        """Extend each endpoint's match by the blocks it is computing for requests sent to it."""
        in_flight = self.in_flight
        if not len(in_flight) or not keys:
            return
        in_flight.prune()
        names = set(in_flight.holders(keys[0]))
        names.update(name for name, run in matched.items() if 0 < run < len(keys))
        for name in names:
            pod = self._pods_by_name.get(name)
            run = matched.get(name, 0)
            while run < len(keys) and (name in in_flight.holders(keys[run]) or
                                       (pod is not None and self.index.holds(pod, keys[run]))):  # fmt: skip
                run += 1
            if run > matched.get(name, 0):
                matched[name] = run

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        self.approximate.pre_request(request, result)
        lookup = request.state.get(_LOOKUP)
        deferred = request.state.get(_DEFERRED)
        endpoints = result.endpoints
        name = endpoints[0].name if endpoints else None
        if deferred is not None:  # the rest of the prompt, encoded now that the answer is written
            del request.state[_DEFERRED]
            tokenization = self.tokenization
            assert tokenization is not None  # (only its prepare_data puts a rest off)
            if deferred.plan.pending >= _THREAD_CHARS:
                if lookup is not None and name is not None:  # the known start's blocks now, the rest's then
                    self._add_sent(name, lookup[0], lookup[1])
                tokenization.finish_later(deferred, lambda ids: self._encoded(request, deferred, ids, name))
                return
            ids = tokenization.finish(deferred)
            if ids is not None:
                self._encoded(request, deferred, ids, name)
                return
        if lookup is not None and name is not None:
            self._add_sent(name, lookup[0], lookup[1])

    def _encoded(self, request: InferenceRequest, deferred: _Deferred, ids: np.ndarray, name: str | None) -> None:
        """A deferred prompt's ids (on the loop, from the worker threads or ``pre_request``): into
        ``TOKENIZED_PROMPT``, its keys whole, and the rest's blocks in flight on ``name``."""
        request.state[TOKENIZED_PROMPT] = ids
        lookup = request.state.get(_LOOKUP)
        if lookup is None:
            return
        known = deferred.known
        same = len(ids) >= len(known) and bool(np.array_equal(ids[: len(known)], known))  # else: unstable
        if not same and deferred.plan.head:
            self.head_mismatches += 1  # the lookup by the head may have missed a holder: counted
        keys = self._keys(request, ids, lookup[2], lookup[0] if same else ())
        request.state[_LOOKUP] = (keys, lookup[1], lookup[2])
        if name is not None:
            self._add_sent(name, keys, lookup[1])

    def _add_sent(self, name: str, keys: list[int], precise: Mapping[str, int]) -> None:
        """The blocks a request sent to ``name`` will compute, past what its events said it held, in flight
        there; for a pod whose events are followed (only its events can confirm them) and not those it
        already stored (a request's ids encoded after the answer can come after its prefill)."""
        pod = self._pods_by_name.get(name)
        if pod is None:
            return
        start = precise.get(name, 0)
        while start < len(keys) and self.index.holds(pod, keys[start]):
            start += 1
        self.in_flight.add(name, keys[start:])

    async def close(self) -> None:
        if self._discovery is not None:
            await self._discovery.close()
            self._discovery = None
        if self.subscriber is not None:
            await self.subscriber.close()
            self.subscriber = None
        if self.tokenization is not None:
            await self.tokenization.close()
