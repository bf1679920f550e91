"""Precise prefix routing (the pods' own KV-cache events) against approximate routing and the peers.

Built on ``bench/routing_quality.py`` (imported, not copied: its traces, oracle, client, counters and
summary): a real Envoy, the picker and the vLLM simulator on 127.0.0.1, the simulator publishing
KV events in vLLM 0.32's format (``--kv-events-config``, each pod on its own port, with a replay
socket) and serving its render endpoints (for vllm-router). The picker is given the pool as an
endpoints file that names each pod's publisher (``kv-events=PORT kv-replay=PORT``).

Policies, each on the same trace with a fresh simulator and router:

* ``rr``: Envoy alone, round robin;
* ``default``: the picker's default profile, i.e. the *approximate* prefix index (what this picker
  sent where) with queue and KV-cache scorers (prefix 3, queue 2, KV 2);
* ``precise``: ``precise-prefix-cache-producer`` feeding the prefix scorer, weighted 5 (queue 2, KV 2)
  (what the pods say they hold), the prompt's token ids computed by the picker from the simulated
  model's own files (:func:`epp.sim.tokens.write_model_files`: what a default simulator computes, as
  a picker with the model's tokenizer mounted does);
* ``precise-remote``: the same with the token ids from ``/tokenize`` of a simulated pod of its own
  (an idle engine: a pod of the pool would answer after the engine work queued in the simulator's one
  process, adding ~50 ms to the P90), the fallback for a picker without the model's files;
* ``sglang-router``, ``vllm-router``: the peers' ``cache_aware`` policies, when
  ``epp.testing.peers`` is there and they are installed (``pip install -e '.[bench]'``).

Workloads: routing_quality's ``a`` (shared prefix), ``b`` (multi-turn), ``c`` (no sharing), and three
that separate the designs:

* ``p``, **cache pressure**: workload a's shape with ``--pressure-groups`` (48) system prompts, pods
  holding ``--pressure-fraction`` (0.13) of their working set each (the pool 1.04 times it) and
  answers of ``--pressure-max-tokens`` (256) tokens, which the pods cache and the approximate index
  does not count: pods evict system prompts all the time, and only a router that knows what they
  still hold avoids sending a prompt where its prefix is gone;
* ``u``, **unseen traffic**: workload a, each item sent either through the gateway or (with
  probability ``--unseen-share``, 0.5) straight to a pod chosen by a second, independent router
  (sticky per system prompt: a hash of it): traffic the picker never sees. Hit rate and TTFT are of
  the gateway's requests only (the pods' counters minus what the direct requests' responses say
  they hit, ``x-sim-prefix-hit-tokens``), against the oracle of the gateway's requests;
* ``h``, **hot prefix**: ``--hot-groups`` (16) system prompts of 1.5-2.5k tokens drawn with zipf
  popularity (``--hot-zipf`` 1.1: the first is a third of the traffic), each with a long unique
  question (1-2k tokens), offered at ``--hot-load`` (0.5) of the pool's capacity *with* prefix hits:
  sending every request of the hot prompt to the pod that holds it overloads that pod; spreading it
  costs a miss per extra pod.

The oracle (routing_quality's: one unlimited cache shared by all, in trace order) bounds every hit
rate. Beside it each workload prints what one cache of the whole pool's size would hit (LRU, as a
pod evicts, and Belady's MIN): where they part (cache pressure: unlimited and MIN 85.1%, LRU 77.6%),
reaching the unlimited oracle takes an eviction order that sees the future, which no router gives.
So a second bound is measured per decision, of routing alone: the simulator answers each request with
what the chosen pod, and the pod of the pool holding the most, had cached of its prompt when it arrived
(``x-sim-held-at-arrival``); the column ``/held`` is the first summed over the gateway's requests as a
share of the second: 100% when every request went where the most of its prefix was, whatever the pods
had evicted before. (It is not the hit rate of a router that always chose so, whose pods would hold
other things; and a scorer that weighs load too gives some of it up on purpose.) At 7c7b554
(``--workloads p,u --policies default,precise,sglang-router,vllm-router --rounds 2``,
medians), of the best held at arrival: p precise 99.9%, approximate 95.3%, sglang-router and
vllm-router 100%; u 99.8 / 87.6 / 78.6 / 79.9%; of the unlimited oracle: p 92.9 / 86.9 / 91.8 / 93.7%,
u 99.1 / 88.5 / 79.4 / 79.4%.
A third reference, computed from the trace as the oracle is (:func:`routing_quality.knowing_router_hit_rate`):
a router that knows every pod's cache, the pods' own sizes and LRU, each request sent where the most
of its prefix is held, one at a time: what perfect knowledge buys greedy routing under cache
pressure (not a bound either way: a router spreading prefixes on purpose could keep more, and real
requests overlap). Printed for workloads with no traffic bypassing the gateway. At 8556c64
(``--workloads p --policies default,precise --rounds 2``, medians): it hits 76.7% on p (the unlimited
oracle 85.1%, one LRU cache of the pool's size 77.6%); precise 78.7%, **102.6%** of it (99.8% of the
best held at arrival, 92.5% of the unlimited oracle), approximate 74.9%, 97.7% of it (95.4%, 88.0%).
A fourth, the router spreading prefixes on purpose (:func:`routing_quality.placed_hit_rate`): each
family (a system prompt's group, a session) placed on one pod knowing the whole trace in advance,
largest first (prompt blocks times requests) on the pod with the fewest placed, the pods' caches
replayed as the knowing router's. On p it keeps **79.7%**, 93.6% of the unlimited oracle (the
knowing router 76.7%, 90.1%): no router over LRU pods gets near 98% of it, since what the oracle
adds is an eviction order that sees the future. On 2026-12-06 (the picker's code 799ddd7's;
``--workloads p,u --policies default,precise,sglang-router,vllm-router``, one round): p precise
77.5%, 91.1% of the oracle (97.2% of the placement), approximate 90.5%, of the best held at arrival
99.5% / 97.3%; u
precise 99.1% of the oracle, approximate 88.5%, sglang-router 74.6%, vllm-router 77.9% (held 99.6
/ 87.0 / 74.2 / 78.2%); TTFT P90 p 411 against sglang-router's 412 ms (1.00x), u 138 against
vllm-router's 441 (0.31x). The same day, ``--workloads a,c,h`` likewise: precise's TTFT P90 40 ms
against vllm-router's 61 (a, 0.66x; sglang-router 88), 514 against sglang-router's 793 (c, 0.65x),
318 against vllm-router's 3,543 (h, **0.09x**; sglang-router 5,939), hit rates 100% of the oracle
on a, 98.3% on h (approximate 91.7%, the peers 92.4 / 98.6%).
Printed per (workload, policy): hit rate and its share of the oracle, TTFT P50/P90, and the picker's CPU
per completed request (its process and scrape worker, from /proc, over the load), or the peer's whole
process (it is the proxy too). Then the targets: precise >= 98% of the oracle on ``p`` and ``u``
(approximate's beside it), and precise's TTFT P90 against the best peer's (<= 1x on every workload, <=
0.8x on ``h``), with the median over the same requests of precise's (and approximate's) TTFT minus the
peer's: two P90s are taken over different requests' tails, the paired difference is what one router
adds to the same request (each round's runs paired, the median of the rounds'); also split into each
family's first request (a session's in b, a system prompt's in a, p, u, h) and the later ones.
``--json`` writes every completed request's TTFT per run (``ttfts_ms``: family, its place among the
family's requests, ms).

Diagnostics: ``--envoy-timing`` prints, per run behind Envoy, Envoy's own times from its access log
(the request phase: the request's last byte in to the upstream request's first byte out, i.e. the
pick; and the response headers' phase) and the picker's mean pick and plugin-call times;
``--split-cores`` pins the simulator to CPU 0 and the router (Envoy and picker, or the peer) and the
client to CPU 1; the policy ``sglang-router+scraped`` (or ``vllm-router+scraped``) runs the peer
while a picker that routes nothing scrapes the pods as it would behind Envoy.

Run: ``python bench/precise_routing.py`` (about 22 minutes for six workloads and six policies on
the 2-core development machine), ``--workloads p,u,h`` for the three, ``--quick`` for a smoke run,
``--rounds N`` to run each (workload, policy) N times and report medians (the policies' order rotated
each round), ``precise+observe`` or ``default+observe`` for a picker behind an Envoy that observes
responses (``epp envoy-config --observe-responses``), ``precise+workers`` or ``default+workers`` for a
picker with ``--workers 2``, ``POLICY@PATH`` (``precise@/tmp/py-old``) to run a picker policy under another interpreter
(a wrapper that puts another checkout first: two trees side by side in one run), ``--precise-weights
P,Q,K`` to give the precise profile other scorer weights (prefix, queue, KV cache; 5,2,2 by default, as
``deploy/config/precise-prefix-cache.yaml``: see the results below).
Results are quoted in ``plugins/producer/precise_prefix_cache.py``'s docstring; the latest, one
side-by-side run on a quiet machine (at d0c9e3f, 1,324 s): precise reached **98.7% of
the oracle on u** (approximate 87.9%, the peers 75-77%), 92.0% on p (approximate 92.8%, the peers
91.7-91.8%; one LRU cache of the pool's size 91.2%), 97.5% on h, 100% on a and b; its TTFT P90
against the best peer's: 0.65x (a), 1.07x (b: 111 against sglang-router's 104 ms, approximate 109),
0.65x (c), 0.94x (p), 0.46x (u), 0.09x (h). Workload b again, 3 rounds (``--workloads b --policies
default,precise,sglang-router --rounds 3``, at f8ca4d5, 371 s): medians TTFT P90 precise 113,
approximate 113, sglang-router 106 ms (1.07x in every round: 113/106, 113/103, 113/106), P50 62 / 58
/ 54 ms, hit rates 100% / 97.9% / 100% of the oracle. The gap is the path, not the routing: the
picker behind Envoy answers each request's ext_proc messages (two round trips before the first
token) and, on these 2 shared cores, takes CPU from the simulated pods (router CPU per request 7.9
ms precise, 4.9 approximate, 3.2 sglang-router); precise's local tokenization adds ~2.1 ms per
request (each turn reuses the conversation's earlier ids; what costs is rendering it and encoding
the new turn's tokens at ~1.3 µs each).

Workload b, where the time goes (2 shared cores, medians of 3 rounds unless said): with
``--split-cores`` (the router's CPU can no longer slow the simulated pods) precise 106 against
sglang-router's 102 ms, 1.04x (1.07x shared); with the pods scraped under sglang-router as the picker
scrapes them (``sglang-router+scraped``: the simulator's CPU 0.16-0.20 cores as behind the picker,
against 0.11-0.14) its P90 stayed 102 ms, so the scrapes are not the gap. Envoy's own clock
(``--envoy-timing``, every request of a run, 2 runs of each policy at 95e94dc and at 7c7b554) puts
the pick at P50 1.52-1.55 ms approximate and 2.8-3.6 ms precise (P90 2.1-2.2 / 4.3-7.2), of which
the picker's code is ~0.3 ms of scheduling and ~0.3 of its ``pre_request`` hooks, precise's
tokenization ~1.1-1.3 ms, and the rest the messages' round trip through Envoy's gRPC client and the
picker's event loop; the response headers' phase adds P50 ~0.3-0.4 ms, the first chunk another round
trip. That is the 2-3 ms at P50 and ~5 ms at P90 between precise and sglang-router (which relays in
its own process). Running the ``pre_request`` hooks after the pick's answer was written, instead of
before it, was tried and taken out again: with every request counted the pick was no faster (P50
approximate 1.53 / 1.52 ms against 1.55 / 1.53; an earlier comparison that seemed to show 0.3-0.6 ms
had read only the part of Envoy's log flushed while it ran).

Observed responses (``epp envoy-config --observe-responses``: the response reaches the client without
a round trip through the picker; epp/envoy/bootstrap.py): ``--workloads b --policies
precise,precise+observe,sglang-router --rounds 3`` at 879605d (356 s), medians: TTFT P90 precise 105,
precise+observe 102, sglang-router 100 ms (1.04x / 1.02x); the same requests' TTFT minus
sglang-router's, median, +2.5 / +2.0 ms; router CPU 3.73 / 3.41 / 1.83 ms a request. What is left is
the request phase (the pick, tokenization included). Again at 9c386d2 (356 s): 103 / 103 / 102 ms
(1.01x each; rounds precise 102, 103, 107, observed 103, 104, 103, sglang-router 101, 103, 102), +3.0 /
+2.1 ms paired, router CPU 3.96 / 3.57 / 1.74 ms: a tie within the rounds' scatter.
On a machine about twice as slow (at f3ae4d4's code, b01342a's; sglang-router's CPU per request 3.04 ms
where it was 1.74), ``--workloads b --policies precise,sglang-router --rounds 5`` (416 s): TTFT P90 115 against
104 ms (**1.10x**; rounds precise 107, 109, 115, 123, 115, sglang-router 103, 106, 105, 104, 104), P50 62
against 54, the same requests' TTFT minus sglang-router's, median, +6.4 ms, router CPU 6.01 / 3.04 ms a request,
hit rates 100% of the oracle both. The gap grew with the machine's slowness (+3.0 ms paired above, +6.4 here)
while the hit rates stayed equal: it is the CPU on the path (the picker's and Envoy's work per message), not
the routing, and a slower or busier core makes it larger.

``--envoy-concurrency N`` gives Envoy N worker threads (1 by default, as the runs above; the peers run
at their runtimes' defaults, which take a thread per core). With 2 (``--workloads b --policies
precise,default,sglang-router --rounds 2 --envoy-timing --envoy-concurrency 2``, at 74df439, a busy
machine) nothing on the path moved: precise's request phase P50 1.58 / 1.67 ms (1.38 / 1.59 with one
thread the same day), approximate's 1.10 / 1.13; the same requests' TTFT minus sglang-router's, median,
precise +2.3 ms, approximate +1.4 (+2.1-2.8 for precise with one thread); TTFT P90 104 / 105 against
sglang-router's 103 / 107 ms, a tie within the rounds' scatter.

Routing or path? On 2026-12-06 (a slow day: sglang-router's CPU 2.3-2.9 ms a request, 1.74 on the
fast day above), at 799ddd7's code: ``--workloads b --policies precise,default,sglang-router --rounds
3 --envoy-timing`` TTFT P90 precise 110, approximate 113, sglang-router 103 ms (**1.07x**), the same
requests' TTFT minus sglang-router's, median, +4.6 / +3.6 ms, hit rates 100% / 97.7% / 100% of the
oracle. Split by request (``--json``'s TTFTs, 2 more rounds): a session's first request, its prompt
cold wherever it goes (median 947 tokens) and so placed by load alone, P50 96-101 ms against
sglang-router's 93, later turns (cached but for the new message) 53-55 against 49-50; the paired
difference the same for both, +5.7 and +5.0 ms (``precise`` in the split line's run below). Were the
routing the gap, it would be on the first requests, whose placement the two routers decide
differently (load against sglang-router's smallest tree); it is the same constant on every request,
the gateway's path. With no load (``python bench/routing_quality.py --workloads b --policies
default,sglang-router,floor --users 1 --duration 20 --drain 10 --rounds 2``: one session at a time,
28 requests a run) the approximate picker's TTFT P50 was 48.7 / 47.9 ms against sglang-router's 46.2 /
45.8: **+2.3 ms** with nothing queued anywhere, the exchange's round trips through Envoy (under the
load, Envoy's clock put the approximate picker's request phase at P50 1.5 ms and the response
headers' at 0.5, and the first chunk takes one more); under the load the same requests gain another
2-3 ms from the 2 cores the pods, Envoy, the picker and the client share. Taking the
warm turn's deferred encoding (``pre_request``, 1.4-1.8 ms a request on the loop) off the event loop
onto the tokenizer's threads (HF ``tokenizers`` releases the GIL) shortened Envoy's request phase
(P50 1.85-1.97 against 2.11-2.25 ms, P90 3.1-3.6 against 4.3-4.4) and nothing else: ``--workloads b
--policies precise,precise@PATH,sglang-router --rounds 3 --envoy-timing`` with ``_THREAD_CHARS`` 0 at
PATH, TTFT P90 109 against 111 ms (sglang-router 107), paired +5.2 against +5.4 ms (first / later
requests +5.8 / +4.9 against +5.7 / +5.0), router CPU 5.6-5.9 against 5.4-5.7 ms a request (the
thread hop): not taken. Nor do observed responses close it on such a day (``--workloads b --policies
precise,precise+observe,sglang-router --rounds 3``): TTFT P90 110 / 108 against 103 ms (1.07x /
1.06x), paired +6.1 / +4.5 ms, the request phase's round trip and the 2 shared cores left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import routing_quality as rq
import xxhash

from epp.envoy.bootstrap import BootstrapOptions, render, render_round_robin
from epp.sim.kvcache import BLOCK_SIZE
from epp.sim.tokens import BYTES_PER_TOKEN, write_model_files
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker
from epp.testing.processes import stop_process

try:
    from epp.testing import peers as _peers
except ImportError:  # the peers' launcher is not on this branch
    _peers = None  # type: ignore[assignment]

MODEL = rq.MODEL
WORKLOADS = {**rq.WORKLOADS, "p": "cache pressure", "u": "unseen traffic", "h": "hot prefix"}
POLICIES = {
    "rr": "round robin",
    "default": "approximate",
    "precise": "precise (KV events)",
    "precise-remote": "precise, /tokenize",
    "sglang-router": "sglang-router",
    "vllm-router": "vllm-router",
}
_PEERS = ("sglang-router", "vllm-router")
_SCRAPED = "+scraped"  # a peer whose pods a picker that routes nothing scrapes all the same
POLICIES |= {f"{p}{_SCRAPED}": f"{p} {_SCRAPED}" for p in _PEERS}
_OBSERVE = "+observe"  # a picker behind an Envoy that observes responses (epp envoy-config --observe-responses)
POLICIES |= {f"{p}{_OBSERVE}": f"{POLICIES[p]}, observed" for p in ("default", "precise")}
_WORKERS = "+workers"  # a picker with --workers 2
POLICIES |= {f"{p}{_WORKERS}": f"{p}, 2 workers" for p in ("default", "precise")}
_HOT_SYSTEM_TOKENS = (1536, 2560)
_HOT_QUESTION_TOKENS = (1024, 2048)
_SETTLE_S = 0.5

_PRECISE_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig: {blockSize: 16}
    indexerConfig:
      tokenizersPoolConfig:
        modelName: MODEL_NAME
        local: {autoDiscoveryDir: "TOKENIZER_DIR"}
        remote: {mode: REMOTE_MODE, url: "TOKENIZER_URL", timeout: 500ms}
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: PREFIX_WEIGHT}
  - {pluginRef: queue-scorer, weight: QUEUE_WEIGHT}
  - {pluginRef: kv-cache-utilization-scorer, weight: KV_WEIGHT}
  - {pluginRef: max-score-picker}
"""


def precise_config(
    model: str,
    tokenizer_dir: str,
    *,
    remote_mode: str = "none",
    remote_url: str = "",
    weights: Sequence[int] = (5, 2, 2),
    prefix_cache_bytes: int | None = None,
) -> str:
    """The precise policy's EndpointPickerConfig (``bench/soak.py --precise`` runs it too): the model's
    tokenizer files in ``tokenizer_dir``, the prefix, queue and KV-cache scorers' ``weights``."""
    where = {"MODEL_NAME": model, "TOKENIZER_DIR": tokenizer_dir, "REMOTE_MODE": remote_mode,
             "TOKENIZER_URL": remote_url, "PREFIX_WEIGHT": str(weights[0]), "QUEUE_WEIGHT": str(weights[1]),
             "KV_WEIGHT": str(weights[2])}  # fmt: skip
    text = _PRECISE_CONFIG
    for key, value in where.items():
        text = text.replace(key, value)
    if prefix_cache_bytes is not None:
        text = text.replace("        remote:", f"        prefixCacheBytes: {prefix_cache_bytes}\n        remote:")
    return text


@dataclass(frozen=True)
class Knobs:
    pressure_groups: int = 48
    pressure_fraction: float = 0.13
    pressure_max_tokens: int = 256
    unseen_share: float = 0.5
    hot_groups: int = 16
    hot_zipf: float = 1.1
    hot_load: float = 0.5


# -- the workloads this bench adds ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One workload as run here: its trace, the pods' cache size, which items bypass the gateway."""

    workload: rq.Workload
    blocks: int
    opts: rq.Options
    direct: frozenset[int] = frozenset()  # indexes of items sent straight to a pod

    def gateway(self) -> rq.Workload:
        items = tuple(item for i, item in enumerate(self.workload.items) if i not in self.direct)
        return replace(self.workload, items=items)


def _hot_workload(opts: rq.Options, knobs: Knobs) -> rq.Workload:
    rng = np.random.default_rng([opts.seed, 77])
    prompts = [rq._text(rng, int(rng.integers(*_HOT_SYSTEM_TOKENS, endpoint=True))) for _ in range(knobs.hot_groups)]
    weights = 1.0 / np.arange(1, knobs.hot_groups + 1) ** knobs.hot_zipf
    p = weights / weights.sum()
    # Capacity with hits: the pool's requests per simulated second when every system prompt is cached.
    pilot = [
        rq._turn(
            (("system", prompts[0]), ("user", rq._text(rng, int(np.mean(_HOT_QUESTION_TOKENS))))),
            opts.max_tokens,
            opts.seed,
        )
    ]
    c = rq._COST
    question = float(np.mean(_HOT_QUESTION_TOKENS))
    context = pilot[0].prompt_tokens + opts.max_tokens / 2
    cost = question * c.prefill_token_s + opts.max_tokens * (c.decode_seq_s + c.kv_read_token_s * context)
    capacity = opts.pods / cost
    rate = knobs.hot_load * capacity
    n = max(1, round(rate * opts.duration / opts.time_scale))
    items = []
    for _ in range(n):
        g = int(rng.choice(knobs.hot_groups, p=p))
        q = rq._text(rng, int(rng.integers(*_HOT_QUESTION_TOKENS, endpoint=True)))
        items.append(
            rq.Item(f"group-{g}", (rq._turn((("system", prompts[g]), ("user", q)), opts.max_tokens, opts.seed),), ())
        )
    gaps = np.random.default_rng([opts.seed, 98]).exponential(1.0 / rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]
    items = [replace(i, at_s=float(at)) for i, at in zip(items, arrivals, strict=True)]
    working_set = sum(len(x) // BYTES_PER_TOKEN for x in prompts)
    return rq.Workload("h", tuple(items), rate, capacity, working_set)


def make_run(kind: str, opts: rq.Options, knobs: Knobs) -> Run:
    if kind in rq.WORKLOADS:
        return Run(rq.make_workload(kind, opts), rq.num_gpu_blocks(opts), opts)
    if kind == "p":
        popts = replace(opts, groups=knobs.pressure_groups, max_tokens=knobs.pressure_max_tokens or opts.max_tokens)
        workload = replace(rq.make_workload("a", popts), name="p")
        blocks = rq.num_gpu_blocks(replace(popts, cache_fraction=knobs.pressure_fraction))
        return Run(workload, blocks, popts)
    if kind == "u":
        workload = replace(rq.make_workload("a", opts), name="u")
        coin = np.random.default_rng([opts.seed, 55]).random(len(workload.items))
        direct = frozenset(int(i) for i in np.flatnonzero(coin < knobs.unseen_share))
        return Run(workload, rq.num_gpu_blocks(opts), opts, direct)
    if kind == "h":
        workload = _hot_workload(opts, knobs)
        longest = max(t.prompt_tokens for item in workload.items for t in item.turns) + opts.max_tokens
        return Run(workload, max(rq.num_gpu_blocks(opts), 4 * -(-longest // BLOCK_SIZE)), opts)
    raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")


def oracle(run: Run, seed: int) -> float:
    """routing_quality's oracle, over the requests the gateway sends (all of them unless some bypass it):
    the cache it models holds what every earlier request computed, the bypassing ones included."""
    return rq.oracle_hit_rate(run.workload, seed=seed, skip=run.direct)


# -- the processes ------------------------------------------------------------------------------------


class _Simulator:
    """``python -m epp.sim`` publishing KV events (each pod on its own port, with a replay socket);
    ``events=False``: a pod that only tokenizes (the precise policy's tokenizer, see ``_Tokenizer``)."""

    def __init__(self, opts: rq.Options, blocks: int, *, pods: int | None = None, events: bool = True) -> None:
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://127.0.0.1:*",
            "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": f"kv@127.0.0.1@{MODEL}",
        }
        pods = opts.pods if pods is None else pods
        self.process = subprocess.Popen(
            [sys.executable, "-m", "epp.sim", "--pods", str(pods), "--seed", str(opts.seed),
             "--time-scale", str(opts.time_scale), "--num-gpu-blocks", str(blocks),
             "--max-model-len", str(blocks * BLOCK_SIZE), "--enable-scale-out",
             *(["--kv-events-config", json.dumps(config)] if events else [])],
            # stderr dropped: sglang-router probes each worker for gRPC, which the simulator's HTTP/1 server
            # logs as a bad request, a traceback each.
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        self.pods: list[str] = []
        self.lines: list[str] = []
        for _ in range(pods):
            line = self.process.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"the simulator exited with status {self.process.wait()}")
            words = line.split()
            self.pods.append(words[1].removeprefix("http://"))
            ports = {k: v.rpartition(":")[2] for k, _, v in (w.partition("=") for w in words[2:])}
            if events:
                self.lines.append(f"{self.pods[-1]} kv-events={ports['kv-events']} kv-replay={ports['kv-replay']}")

    def endpoints_file(self, directory: str) -> str:
        path = Path(directory) / "pool.txt"
        path.write_text("\n".join(self.lines) + "\n")
        return str(path)

    def stop(self) -> None:
        stop_process(self.process)


def peer_unavailable(kind: str) -> str | None:
    if _peers is None:
        return "epp.testing.peers is not on this branch (the peers helper's launcher)"
    return _peers.unavailable(kind)


# -- the traffic the picker does not see -----------------------------------------------------------------


async def _direct(run: Run, pods: Sequence[str], opts: rq.Options, tally: Counter[str]) -> None:
    """The bypassing items, at their arrival times, each to the pod its system prompt hashes to."""
    if not run.direct:
        return
    t0 = time.perf_counter()
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=rq._REQUEST_TIMEOUT_S)) as session:

        async def one(item: rq.Item) -> None:
            turn = item.turns[0]
            pod = pods[xxhash.xxh64_intdigest(turn.messages[0][1].encode()) % len(pods)]
            body = {
                "model": MODEL,
                "messages": [{"role": r, "content": c} for r, c in turn.messages],
                "max_tokens": opts.max_tokens,
                "ignore_eos": True,
            }
            try:
                async with session.post(f"http://{pod}/v1/chat/completions", json=body) as r:
                    await r.read()
                    if r.status == 200:
                        tally["hits"] += int(r.headers.get("x-sim-prefix-hit-tokens", "0"))
                        tally["queries"] += turn.prompt_tokens
                        tally["requests"] += 1
                    else:
                        tally["errors"] += 1
            except (aiohttp.ClientError, TimeoutError):
                tally["errors"] += 1

        for i in sorted(run.direct):
            item = run.workload.items[i]
            delay = t0 + item.at_s * opts.time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(item)))
        await asyncio.gather(*tasks)


async def _load(url: str, run: Run, pods: Sequence[str], opts: rq.Options) -> tuple[list[rq.Record], int, Counter[str]]:
    tally: Counter[str] = Counter()
    gateway = rq._drive(url, run.gateway(), opts)
    (records, unfinished), _ = await asyncio.gather(gateway, _direct(run, pods, opts, tally))
    return records, unfinished, tally


# -- one policy on one workload ------------------------------------------------------------------------


@dataclass
class Row:
    result: rq.Result
    picker_ms_per_request: float  # the router's CPU per completed request (the picker's, or the peer's)
    direct_requests: int = 0
    # Each completed request's TTFT (ms) by (family, its place among the family's requests in sending
    # order): the same request in every policy's run of the trace (see _paired).
    ttfts: dict[tuple[str, int], float] = field(default_factory=dict, repr=False)


def _ttfts(records: Sequence[rq.Record]) -> dict[tuple[str, int], float]:
    seen: Counter[str] = Counter()
    out = {}
    for r in sorted(records, key=lambda r: r.sent):
        family = r.family or ""
        key = (family, seen[family])
        seen[family] += 1
        if r.ttft is not None and r.done is not None:
            out[key] = r.ttft * 1000
    return out


def _paired(runs: Sequence[Row], kind: str, policy: str, other: str, later: bool | None = None) -> float | None:
    """The median over the requests both completed of ``policy``'s TTFT minus ``other``'s, in ms (the
    median of the rounds' medians, each round's runs paired): what separates two routers on the same
    requests, which two P90s taken over different tails do not show. ``later``: only the requests of a
    family (a session, a system prompt's group) after its first (True), or only each family's first
    (False); requests of no family are left out of either."""
    by_round: dict[int, dict[str, Row]] = {}
    for row in runs:
        if row.result.workload == kind:
            by_round.setdefault(row.result.round, {})[row.result.policy] = row
    medians = []
    for pair in by_round.values():
        if policy in pair and other in pair:
            a, b = pair[policy].ttfts, pair[other].ttfts
            diffs = [a[k] - b[k] for k in a.keys() & b.keys() if later is None or (k[0] != "" and (k[1] > 0) is later)]
            if diffs:
                medians.append(float(np.median(diffs)))
    return float(np.median(medians)) if medians else None


# Envoy's view of its own path, per request (access log): from the request's last byte in to the
# upstream request's first byte out (the request phase: with the picker, its pick), and from the
# upstream answer's first byte (its headers) to the client's (the response headers' phase).
_TIMING_FORMAT = "%COMMON_DURATION(DS_RX_END:US_TX_BEG:us)% %COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%\n"


def _log_timing(bootstrap: dict[str, Any], path: Path) -> None:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": str(path), "log_format": {"text_format_source": {"inline_string": _TIMING_FORMAT}}}}]  # fmt: skip


def _timing_summary(path: Path) -> str:
    """Medians and P90s of the two phases in Envoy's access log, in ms."""
    phases: list[list[float]] = [[], []]
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            for i, field in enumerate(line.split()[:2]):
                if field.isdigit():
                    phases[i].append(int(field) / 1000)
    parts = []
    for name, values in zip(("request phase", "response headers"), phases, strict=True):
        if values:
            parts.append(
                f"{name} P50 {np.percentile(values, 50):.2f} P90 {np.percentile(values, 90):.2f} ms"
                f" ({len(values)} requests)"
            )
    return "; ".join(parts) or "no access log"


def _picker_metrics(metrics_port: int) -> list[Any]:
    """The metric families on the picker's /metrics page."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def _scheduling_summary(metrics_port: int) -> str:
    """The picker's own mean times: from a complete request to its pick (the scheduler's end to end),
    and each plugin call by extension point, in ms."""
    sums: dict[str, list[float]] = {}
    for family in _picker_metrics(metrics_port):
        if family.name not in ("inference_extension_scheduler_e2e_duration_seconds",
                               "inference_extension_plugin_duration_seconds"):  # fmt: skip
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[1]
            if kind not in ("sum", "count"):
                continue
            labels = sample.labels
            key = "pick" if "e2e" in family.name else f"{labels['extension_point']}:{labels['plugin_name']}"
            sums.setdefault(key, [0.0, 0.0])[kind == "count"] += sample.value
    return ", ".join(f"{k} {v[0] / v[1] * 1e3:.3f}" for k, v in sums.items() if v[1]) + " ms (means)"


def _pin_tree(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its descendants onto ``cpus`` (sched_setaffinity is per thread)."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as children:
                for child in children.read().split():
                    _pin_tree(int(child), cpus)


def run_policy(
    run: Run,
    policy: str,
    oracle_rate: float,
    weights: tuple[int, int, int] = (5, 2, 2),
    split_cores: bool = False,
    envoy_timing: bool = False,
    envoy_concurrency: int = 1,
) -> Row:
    """One policy on one run; ``weights``: the precise profile's prefix, queue and KV-cache weights;
    ``split_cores``: the simulator alone on CPU 0, the router (Envoy and picker, or the peer) and this
    client on CPU 1, so that the router's CPU cannot slow the simulated pods down. A peer's policy
    with ``+scraped`` (``sglang-router+scraped``): its pods are scraped all the same, by a picker that
    routes nothing (the simulator's pods share one event loop, which serves the scrapes too)."""
    opts = run.opts
    base, _, python = policy.partition("@")  # precise@PATH: the picker under another interpreter
    workers, base = base.endswith(_WORKERS), base.removesuffix(_WORKERS)
    observe, base = base.endswith(_OBSERVE), base.removesuffix(_OBSERVE)
    sim = _Simulator(opts, run.blocks)
    # precise-remote's token ids come from /tokenize, of a pod of its own (an idle engine: the answer is
    # not queued behind the pool's work), as llm-d runs its tokenizer beside the picker; precise's from
    # the simulated model's own files (epp.sim.tokens.write_model_files), as a picker with the model's
    # tokenizer mounted computes them.
    tokenizer = _Simulator(opts, run.blocks, pods=1, events=False) if base == "precise-remote" else None
    picker: PickerProcess | None = None
    tokenization = ""
    envoy: EnvoyProcess | None = None
    router: Any = None
    directory = tempfile.mkdtemp(prefix="epp-precise-")
    try:
        pids = {"simulator": sim.process.pid}
        if tokenizer is not None:
            pids["tokenizer"] = tokenizer.process.pid
        peer, scraped = base.removesuffix(_SCRAPED), base.endswith(_SCRAPED)
        if peer in _PEERS:
            assert _peers is not None
            router = _peers.PeerRouter.start(peer, sim.pods, policy="cache_aware")
            url = router.url
            pids["router"] = router.pid
            if scraped:  # the pods answer the picker's scrapes as they do behind it (its CPU not counted)
                picker = PickerProcess([], extra_args=["--endpoints-file", sim.endpoints_file(directory)])
                picker.start()
                time.sleep(_SETTLE_S)
        else:
            gateway = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0)
            if base == "rr":
                bootstrap = render_round_robin(replace(gateway, pool_endpoints=tuple(sim.pods)))
            else:
                extra = ["--endpoints-file", sim.endpoints_file(directory)]
                if base.startswith("precise"):
                    config = Path(directory) / "precise.yaml"
                    if tokenizer is not None:  # the engine's /tokenize, no local files
                        text = precise_config(MODEL, "/nonexistent", remote_mode="tokenize",
                                              remote_url=f"http://{tokenizer.pods[0]}", weights=weights)  # fmt: skip
                    else:
                        model = write_model_files(Path(directory) / "model")
                        text = precise_config(MODEL, str(model), weights=weights)
                    config.write_text(text)
                    extra += ["--config-file", str(config)]
                if workers:
                    extra += ["--workers", "2"]
                picker = PickerProcess([], extra_args=extra, python=python or sys.executable)
                picker.start()
                pids["picker"] = picker.pid
                bootstrap = render(replace(gateway, picker_port=picker.grpc_port, observe_responses=observe))
            if envoy_timing:
                _log_timing(bootstrap, Path(directory) / "access.log")
            envoy = EnvoyProcess(bootstrap, concurrency=envoy_concurrency)
            envoy.start()
            pids["envoy"] = envoy.pid
            if picker is not None:
                wait_for_picker(envoy)
                time.sleep(_SETTLE_S)
            url = f"http://127.0.0.1:{envoy.listen_port}"
        before = asyncio.run(rq._sim_counters(sim.pods))
        if split_cores:
            for name, pid in pids.items():
                _pin_tree(pid, {0} if name == "simulator" else {1})
            os.sched_setaffinity(0, {1})
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client0 = time.process_time()
        wall0 = time.perf_counter()
        records, unfinished, tally = rq._run_loop(_load(url, run, sim.pods, opts))
        wall = time.perf_counter() - wall0
        cpu_s = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        cpu = {name: s / wall for name, s in cpu_s.items()}
        cpu["client"] = (time.process_time() - client0) / wall
        after = asyncio.run(rq._sim_counters(sim.pods))
        if base.startswith("precise") and picker is not None:
            tokenization = _tokenization(picker.metrics_port)
        if envoy_timing and envoy is not None and picker is not None:
            print(f"  {policy} picker: {_scheduling_summary(picker.metrics_port)}")
    finally:
        if split_cores:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        if envoy is not None:
            envoy.stop()
            if envoy_timing:  # read once Envoy has stopped: it flushes its access log every 10 s, and at exit
                print(f"  {policy} Envoy: {_timing_summary(Path(directory) / 'access.log')}")
        if picker is not None:
            picker.stop()
            with contextlib.suppress(OSError):
                os.unlink(picker.log_path)
        if router is not None:
            router.stop()
        if tokenizer is not None:
            tokenizer.stop()
        sim.stop()
        shutil.rmtree(directory, ignore_errors=True)
    # The pods' counters count every request; the bypassing ones' share is taken out.
    after = Counter(after)
    after["vllm:prefix_cache_hits_total"] -= tally["hits"]
    after["vllm:prefix_cache_queries_total"] -= tally["queries"]
    result = rq._summarise(run.gateway(), policy, records, unfinished, before, after, cpu, oracle_rate, wall)
    # The router's CPU: the picker (with the pod that tokenizes for it), the peer, or Envoy for rr.
    routed = cpu_s.get("picker", cpu_s.get("router", cpu_s.get("envoy", 0.0))) + cpu_s.get("tokenizer", 0.0)
    per_request = routed / result.completed * 1e3 if result.completed else math.nan
    if tokenization:
        print(f"  {policy} tokenization: {tokenization}")
    return Row(result, per_request, tally["requests"], _ttfts(records))


def _tokenization(metrics_port: int) -> str:
    """What the picker's precise producer says of its tokenization: attempts and their mean time by
    source (``epp_tokenize_duration_seconds``) and requests scored with the approximate index for
    want of token ids, by reason (``epp_tokenize_fallbacks_total``: none when set up right)."""
    sums: dict[tuple[str, str], float] = {}
    for family in _picker_metrics(metrics_port):
        for sample in family.samples:
            if sample.name in ("epp_tokenize_duration_seconds_sum", "epp_tokenize_duration_seconds_count"):
                key = (sample.labels.get("source", ""), sample.name.rsplit("_", 1)[1])
                sums[key] = sums.get(key, 0.0) + sample.value
            elif sample.name == "epp_tokenize_fallbacks_total" and sample.value:
                sums[("fallback " + sample.labels.get("reason", ""), "count")] = sample.value
    parts = []
    for source in sorted({source for source, _ in sums}):
        count = sums.get((source, "count"), 0.0)
        if source.startswith("fallback"):
            parts.append(f"{source} {count:.0f}")
        elif count:
            parts.append(f"{source} {count:.0f} x {sums.get((source, 'sum'), 0.0) / count * 1e3:.2f} ms")
    return ", ".join(parts) or "none"


# -- the report -----------------------------------------------------------------------------------------


def _medians(rows: Sequence[Row], kinds: Sequence[str], policies: Sequence[str]) -> list[Row]:
    """One row per (workload, policy), in that order: each figure the median of its rounds (one round: itself)."""
    out = []
    for kind in kinds:
        for policy in policies:
            runs = [row for row in rows if (row.result.workload, row.result.policy) == (kind, policy)]
            if not runs:
                continue
            first = runs[0].result
            result = replace(
                first,
                hit_rate=float(np.median([r.result.hit_rate for r in runs])),
                ttft_p50_ms=float(np.median([r.result.ttft_p50_ms for r in runs])),
                ttft_p90_ms=float(np.median([r.result.ttft_p90_ms for r in runs])),
                completed=min(r.result.completed for r in runs),
                held_share=_median_or_none([r.result.held_share for r in runs]),
            )
            out.append(Row(result, float(np.median([r.picker_ms_per_request for r in runs])), runs[0].direct_requests))
    return out


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known else None


def _table(rows: Sequence[Row]) -> str:
    head = (
        f"{'workload':<18} {'policy':<22} {'hit rate':>8} {'/oracle':>7} {'/held':>6} {'TTFT P50':>9} {'P90':>8} "
        f"{'ok/sent':>9} {'router CPU/req':>14}"
    )
    lines = [head, "-" * len(head)]
    last = ""
    for row in rows:
        r = row.result
        label = f"{r.workload} {WORKLOADS[r.workload]}" if r.workload != last else ""
        last = r.workload
        share = f"{r.hit_rate / r.oracle_hit_rate:7.1%}" if r.oracle_hit_rate > 0 else f"{'-':>7}"
        held = f"{r.held_share:6.1%}" if r.held_share is not None else f"{'-':>6}"
        lines.append(
            f"{label:<18} {POLICIES.get(r.policy, r.policy):<22} {r.hit_rate:8.1%} {share} {held} "
            f"{r.ttft_p50_ms:7.0f}ms {r.ttft_p90_ms:6.0f}ms {f'{r.completed}/{r.requests}':>9} "
            f"{row.picker_ms_per_request:11.2f} ms"
        )
        if r.workload != (rows[rows.index(row) + 1].result.workload if rows.index(row) + 1 < len(rows) else None):
            lines.append(f"{'':<18} {'oracle (bound)':<22} {r.oracle_hit_rate:8.1%}")
    return "\n".join(lines)


def _targets(rows: Sequence[Row], bounds: dict[str, dict[str, float]] | None = None,
             runs: Sequence[Row] = ()) -> list[str]:  # fmt: skip
    by = {(row.result.workload, row.result.policy): row.result for row in rows}
    out = []
    for kind in ("p", "u"):
        precise, approx = by.get((kind, "precise")), by.get((kind, "default"))
        if precise is not None and precise.oracle_hit_rate > 0:
            line = (
                f"{kind} {WORKLOADS[kind]}: precise {precise.hit_rate / precise.oracle_hit_rate:.1%} of the oracle"
                f" (target >= 98%)"
            )
            if approx is not None:
                line += f", approximate {approx.hit_rate / approx.oracle_hit_rate:.1%}"
            if precise.held_share is not None:
                line += f"; of the best held at arrival: precise {precise.held_share:.1%}"
                if approx is not None and approx.held_share is not None:
                    line += f", approximate {approx.held_share:.1%}"
            finite = (bounds or {}).get(kind)
            if finite:
                line += (
                    f"; hit rate {precise.hit_rate:.1%} against one LRU cache of the pool's size "
                    f"{finite['lru']:.1%} (MIN {finite['min']:.1%})"
                )
                if "knowing" in finite:
                    line += (
                        f", a router knowing every pod's cache {finite['knowing']:.1%} "
                        f"(precise {precise.hit_rate / finite['knowing']:.1%} of it)"
                    )
                if "placed" in finite:
                    line += (
                        f", the families placed knowing the trace {finite['placed']:.1%} "
                        f"({finite['placed'] / precise.oracle_hit_rate:.1%} of the oracle)"
                    )
            out.append(line)
    for kind in dict.fromkeys(row.result.workload for row in rows):
        precise = by.get((kind, "precise"))
        peers = [by[(kind, p)] for p in _PEERS if (kind, p) in by and math.isfinite(by[(kind, p)].ttft_p90_ms)]
        if precise is None or not peers:
            continue
        best = min(peers, key=lambda r: r.ttft_p90_ms)
        ratio = precise.ttft_p90_ms / best.ttft_p90_ms
        goal = 0.8 if kind == "h" else 1.0
        line = (
            f"{kind} {WORKLOADS[kind]}: precise TTFT P90 {precise.ttft_p90_ms:.0f} ms = {ratio:.2f}x the best "
            f"peer's ({best.policy}, {best.ttft_p90_ms:.0f} ms); target <= {goal:.1f}x"
        )
        observed = by.get((kind, "precise" + _OBSERVE))
        if observed is not None and math.isfinite(observed.ttft_p90_ms):
            line += (
                f"; observed responses {observed.ttft_p90_ms:.0f} ms = {observed.ttft_p90_ms / best.ttft_p90_ms:.2f}x"
            )
        scraped = by.get((kind, best.policy + _SCRAPED))
        if scraped is not None and scraped.ttft_p90_ms > 0:
            line += (
                f"; {precise.ttft_p90_ms / scraped.ttft_p90_ms:.2f}x the same peer's with its pods scraped "
                f"as the picker scrapes them ({scraped.ttft_p90_ms:.0f} ms)"
            )
        names = ("precise", "precise-remote", "default", "precise" + _OBSERVE, "default" + _OBSERVE)
        pickers = [p for k, p in by if k == kind and p.partition("@")[0] in names]
        paired = {p: d for p in pickers if (d := _paired(runs, kind, p, best.policy)) is not None}
        if paired:
            line += "; the same requests' TTFT minus the peer's, median: " + ", ".join(
                f"{p} {d:+.1f} ms" for p, d in paired.items()
            )
            if any(k[0] and k[1] for row in runs if row.result.workload == kind for k in row.ttfts):  # families
                split = {p: (_paired(runs, kind, p, best.policy, False), _paired(runs, kind, p, best.policy, True))
                         for p in paired}  # fmt: skip
                line += ("; a family's first request (a session's, a system prompt's) / its later ones: "
                         + ", ".join(f"{p} {first:+.1f} / {rest:+.1f} ms" for p, (first, rest) in split.items()
                                     if first is not None and rest is not None))  # fmt: skip
        out.append(line)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    d, k = rq.Options(), Knobs()
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 s of arrivals, 15 s drain")
    parser.add_argument("--workloads", default="a,b,c,p,u,h")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--pods", type=int, default=d.pods)
    parser.add_argument("--duration", type=float, default=d.duration)
    parser.add_argument("--drain", type=float, default=d.drain)
    parser.add_argument("--load", type=float, default=d.load)
    parser.add_argument("--time-scale", type=float, default=d.time_scale)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--pressure-groups", type=int, default=k.pressure_groups)
    parser.add_argument("--pressure-fraction", type=float, default=k.pressure_fraction)
    parser.add_argument("--pressure-max-tokens", type=int, default=k.pressure_max_tokens)
    parser.add_argument("--unseen-share", type=float, default=k.unseen_share)
    parser.add_argument("--hot-groups", type=int, default=k.hot_groups)
    parser.add_argument("--hot-zipf", type=float, default=k.hot_zipf)
    parser.add_argument("--hot-load", type=float, default=k.hot_load)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each (workload, policy), the policies' order rotated each round; "
        "the table and the targets take the medians",
    )
    parser.add_argument(
        "--precise-weights", default="5,2,2", help="the precise profile's prefix, queue and KV-cache scorer weights"
    )
    results = Path(__file__).resolve().parent / "results"
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="the simulator alone on CPU 0, the router and the client on CPU 1 (needs 2 CPUs)",
    )
    parser.add_argument(
        "--envoy-timing",
        action="store_true",
        help="print Envoy's request-phase and response-headers times per run (its access log)",
    )
    parser.add_argument(
        "--envoy-concurrency",
        type=int,
        default=1,
        help="Envoy's worker threads (the peers' runtimes take one per core)",
    )
    parser.add_argument("--json", type=Path, default=results / "precise_routing.json")
    args = parser.parse_args(argv)
    duration, drain = (3.0, 15.0) if args.quick else (args.duration, args.drain)
    kinds = [w for w in args.workloads.split(",") if w]
    policies = [p for p in args.policies.split(",") if p]
    try:
        prefix_w, queue_w, kv_w = (int(w) for w in args.precise_weights.split(","))
    except ValueError:
        parser.error(f"--precise-weights takes three integers, prefix,queue,kv: got {args.precise_weights!r}")
    weights = (prefix_w, queue_w, kv_w)
    if args.split_cores and not {0, 1} <= os.sched_getaffinity(0):
        parser.error("--split-cores needs CPUs 0 and 1")
    for kind in kinds:
        if kind not in WORKLOADS:
            parser.error(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")
    for policy in policies:
        if policy.partition("@")[0] not in POLICIES:
            parser.error(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
    skipped = {p: why for p in policies
               if (peer := p.removesuffix(_SCRAPED)) in _PEERS and (why := peer_unavailable(peer))}  # fmt: skip
    for policy, why in skipped.items():
        print(f"{policy}: left out: {why}")
    policies = [p for p in policies if p not in skipped]
    opts = rq.Options(
        pods=args.pods,
        duration=duration,
        drain=drain,
        load=args.load,
        time_scale=args.time_scale,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    knobs = Knobs(
        args.pressure_groups,
        args.pressure_fraction,
        args.pressure_max_tokens,
        args.unseen_share,
        args.hot_groups,
        args.hot_zipf,
        args.hot_load,
    )
    rows: list[Row] = []
    bounds: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    for kind in kinds:
        run = make_run(kind, opts, knobs)
        bound = oracle(run, run.opts.seed)
        pool = run.blocks * run.opts.pods
        finite = {p: rq.finite_hit_rate(run.workload, pool, seed=run.opts.seed, skip=run.direct, policy=p)
                  for p in ("lru", "min")}  # fmt: skip
        if not run.direct:  # (traffic the picker does not see goes where another router sends it: not modelled)
            finite["knowing"] = rq.knowing_router_hit_rate(run.workload, run.opts.pods, run.blocks, seed=run.opts.seed)
            finite["placed"] = rq.placed_hit_rate(run.workload, run.opts.pods, run.blocks, seed=run.opts.seed)
        bounds[kind] = finite
        print(f"workload {kind} ({WORKLOADS[kind]}): {run.workload.requests} requests "
              f"({len(run.direct)} bypassing the gateway), {run.blocks} blocks per pod, oracle {bound:.1%}; "
              f"one cache of the pool's {pool} blocks: LRU {finite['lru']:.1%}, MIN {finite['min']:.1%}"
              + (f"; a router knowing every pod's cache {finite['knowing']:.1%}, the trace's families placed "
                 f"over the pods knowing it {finite['placed']:.1%}" if "knowing" in finite else ""),
              flush=True)  # fmt: skip
        for n in range(args.rounds):
            for policy in policies[n % len(policies) :] + policies[: n % len(policies)]:
                row = run_policy(
                    run, policy, bound, weights, args.split_cores, args.envoy_timing, args.envoy_concurrency
                )
                row = replace(row, result=replace(row.result, round=n))
                rows.append(row)
                r = row.result
                share = f"{r.hit_rate / bound if bound else 0:.1%} of the oracle"
                if r.held_share is not None:
                    share += f", {r.held_share:.1%} of the best held at arrival"
                print(f"  {policy:<14} hit {r.hit_rate:.1%} ({share}), "
                      f"TTFT P50 {r.ttft_p50_ms:.0f} P90 {r.ttft_p90_ms:.0f} ms, {r.completed}/{r.requests} done, "
                      f"router {row.picker_ms_per_request:.2f} ms CPU/request"
                      + (f" (round {n + 1})" if args.rounds > 1 else ""), flush=True)  # fmt: skip
    medians = _medians(rows, kinds, policies)
    print()
    print(_table(medians) + (f"\n(medians of {args.rounds} rounds)" if args.rounds > 1 else ""))
    print()
    for line in _targets(medians, bounds, rows):
        print(line)
    print(f"\n{time.perf_counter() - started:.0f} s in all; TTFTs are wall clock at time scale {opts.time_scale}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "options": asdict(opts),
        "knobs": asdict(knobs),
        "skipped": skipped,
        "finite_bounds": bounds,
        "rows": [
            {
                **asdict(row.result),
                "router_ms_per_request": row.picker_ms_per_request,
                "direct_requests": row.direct_requests,
                "ttfts_ms": [[family, turn, ms] for (family, turn), ms in row.ttfts.items()],
            }
            for row in rows
        ],
    }
    args.json.write_text(json.dumps(rq._json_safe(report), indent=1, allow_nan=False))
    print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
