"""Routing quality and routing CPU: hit rate, TTFT, throughput and CPU per request of each policy, on one trace.

Everything runs on 127.0.0.1: a real Envoy, the picker (``epp serve``, a child process) and the vLLM
simulator (``python -m epp.sim``, a child process, 8 pods by default), or in Envoy's and the picker's
place one of the peers, sglang-router or vllm-router (:mod:`epp.testing.peers`). The client is this
process (asyncio + aiohttp), streaming OpenAI chat completions through Envoy or the peer.

Workloads (generated from ``--seed``; no downloads; text is 4 characters per token, the simulator's
tokeniser, and every request asks for ``--max-tokens`` tokens with ``ignore_eos`` so output length is
fixed):

* **a, shared prefix**: ``--groups`` (32) system prompts of 2k-6k tokens (uniform), each request is one
  group's system prompt plus a fresh 16-64-token question. Group popularity is **uniform** by default;
  ``--popularity zipf`` draws groups with probability ~ 1/rank^``--zipf-s`` instead.
* **b, multi-turn chat**: sessions of 3-8 turns, each with its own 256-1024-token system prompt; every
  turn resends the whole history (earlier questions and the simulator's answers, which are a
  deterministic function of the prompt, so the trace knows them in advance) plus a new 64-512-token
  user message. The next turn is sent when the previous answer has arrived plus a think time
  (exponential, mean 0.5 simulated seconds).
* **c, no sharing**: one unique user message of 2k-6k tokens per request.

Policies, each run on the same trace with a freshly started simulator, picker and Envoy (cold caches
and a cold prefix index): ``rr`` Envoy alone, round robin over the pool (no ext_proc); ``queue-kv`` the
picker with queue-scorer 2 + kv-cache-utilization-scorer 2 (``deploy/config/queue-kv-only.yaml``);
``default`` the picker with no config: upstream's default profile (queue 2, KV 2, prefix 3);
``config:PATH`` the picker with any other config file, to try a variant on the same trace;
``floor`` a server that gives Envoy the same ext_proc answers with no work, round robin
(``bench/passthrough_picker.py``: no parsing, routing, accounting or scraping, on epp's transport),
counted as the picker: what the reference exchange's messages cost any picker on this transport;
a picker policy ending ``@PYTHON`` runs the picker under that interpreter (a wrapper that puts another
checkout first: two trees side by side, ``default@/tmp/old-python,default``);
``sglang-router`` and ``vllm-router`` the peers (PyPI; ``pip install -e '.[bench]'``) with their
``cache_aware`` policy, the client sending to the router instead of Envoy (``sglang-router:round_robin``
and the like for their other policies). sglang-router's cache_aware keeps a radix tree of request text
per pod; vllm-router's builds its tree from token ids it asks the pods for, posting each request to
*every* pod's ``/v1/chat/completions/render`` (8 renders per request here: that work lands on the pods,
whose CPU doubles in its runs), so the simulator always runs with ``--enable-scale-out`` (the render
endpoints, as real vLLM needs too; nothing else changes); the run reads the router's counters and
prints how many token-id inputs it got and warns if any request was routed without them.

**Oracle** (a bound on the hit rate, computed from the trace with the simulator's own tokeniser,
output generator and block hashes): requests in trace order, one cache of unlimited size shared by
all (as if every request went to a pod holding every block ever computed); a request hits its
longest run of leading prompt blocks already computed, in whole blocks, excluding the last prompt
token, exactly as the simulator counts; then the blocks of its prompt and output (all but the last
output token, whose KV is never computed) join the cache. It is an upper bound because a block can
only be found on a pod if some earlier request computed it there, and every block any earlier
request computed is in the oracle's cache; a finite cache, routing to a pod without the block, or
two requests of a prefix computing it concurrently can only lose hits. (Two exceptions could let the
measured rate exceed it slightly: a preempted request is counted again by the simulator when
readmitted (preemptions are printed), and requests admitted out of arrival order. Workload b's turns
are ordered by the client, and a and c are order-free: any order gives the same oracle.)
:func:`finite_hit_rate` is the same oracle with its one cache bounded (``bench/precise_routing.py``
gives it the pool's total blocks): LRU in vLLM's order, which matches the simulator run one request
at a time with that cache to 0.1 point, or Belady's MIN (the block used farthest ahead goes first).

Measured per run: hit rate = Δ``vllm:prefix_cache_hits_total`` / Δ``vllm:prefix_cache_queries_total``
summed over the pods (the simulator's counters, in tokens); TTFT P50/P90, client-side, from sending
the request to the first SSE chunk that carries a generated token (a chunk without one, such as
the chat role chunk, is skipped); throughput = completed requests/s and
output tokens/s from the first send to the last completion; the CPU (user+system, from /proc) each
process used during the load, in cores, and the routing CPU (below). Diagnostics: stickiness (share
of requests of a group or session that went to the same pod as the previous one of that family), pod
imbalance (busiest pod's requests / mean), preemptions, how late the client sent (P99 lag: a late
client means a busy CPU).

Load. Open loop by default: Poisson arrivals (sessions for b) at ``--load`` (0.7) times the pool's
capacity *without any cache hit*, computed from the simulator's cost model (``epp.sim.config``: 40 µs
per prefilled token, 80 µs + 40 ns x context per decoded token) and the trace's mean request, i.e.
round robin's worst case; prefix hits lower the real load. ``--users N`` runs closed loop instead:
N users, each sending its next item (request, or whole session) as soon as the last one finished.
Simulated time runs at ``--time-scale`` wall seconds per simulated second (default 2, so each policy
sees the same work at half the wall rate, keeping the four processes well under this 2-core
machine's capacity); reported latencies are wall clock, i.e. time-scale x the simulated GPU's.

Cache size. Each pod gets ``--cache-fraction`` (0.25) of workload a's prefix working set (the sum of
the group system prompts) as KV blocks: the pool holds the working set twice over, one pod a quarter
of it. That is the regime routing is for. If every pod held every prefix (``--num-gpu-blocks 16384``,
the simulator's default), round robin would only pay each prefix's first miss once per pod instead of
once per pool, and its hit rate would approach the oracle's as a run gets longer.

Routing CPU (issue 14's side-by-side figure): **CPU-seconds per 1,000 completed requests** of the
processes that route, user + system from /proc over the load (first send to last answer), divided by
the requests completed: the picker (its scrape worker included) *above its idle rate*, and Envoy
apart; a peer router whole (it is the whole proxy: HTTP in, routing, HTTP out); Envoy alone for
``rr``. The picker's idle rate is measured on the same pool just before each load: ``--idle-window``
(5) seconds of no traffic after Envoy admitted it, CPU / wall = cores, printed beside the figure;
idle x the load's wall time is subtracted. The pods and the client are not routing and not counted.
The ``floor`` policy's figure beside the picker's splits it: the protocol's messages, and what epp's
own work adds (the CPU table prints the floor's ratio to sglang-router's below the target's line).
The picker's idle rate at another pool size (the issue's target is at 100 pods) comes from
``bench/scrape_cost.py``'s stand-in pods: ``--idle-pods 100`` (``--skip-routing`` for that alone).
Each output token is one streamed SSE event, and every event crosses Envoy -> picker -> Envoy
(issue 14: ~0.1-0.25 ms of picker CPU each), while a peer relays it in-process: keep outputs short
(``--max-tokens``, default 16, as in the issue's measurement) to compare the cost of *routing*;
longer outputs measure the per-chunk cost instead. ``--rounds N`` runs every workload x policy N
times, the policies alternating within each round (and each round starting one policy further on);
the tables show medians, the CPU table each round's figure too.

Run: ``python bench/routing_quality.py`` (about 6 minutes: 3 workloads x 3 policies x 30 s of
arrivals plus start-up and drain; ~0.15 cores for round robin, ~0.5-0.7 with the picker, all four
processes together, on the 2-core development machine), ``--quick`` for about a minute (3 s of
arrivals per run: too few requests per group for stable figures; for development). Prints the
table and each run's CPU, writes ``--json`` and a PNG chart (``--png``; needs matplotlib:
``pip install -e '.[bench]'``). Everything it starts is stopped when it ends or fails.

The side-by-side CPU run: ``python bench/routing_quality.py --cpu-comparison --idle-pods 100``
(= ``--policies rr,default,sglang-router,vllm-router --rounds 3 --max-tokens 16 --duration 20
--drain 30``, explicit flags win; ~17 minutes here). It prints the routing-quality table (medians),
the routing-CPU table, each policy's median over all runs, and the issue's target line: the picker's
CPU above idle against sglang-router's, target ≤ 0.5.

Measured (2-core shared machine, other benches running; sglang-router 0.3.2, vllm-router 0.1.17;
picker on grpc.aio, before the lead's own HTTP/2 transport), ``--cpu-comparison --idle-pods 100``,
16 minutes; medians of 3 rounds, routing CPU-seconds per 1,000 requests (per-workload a / b / c):

=====================  ====================  =========================  ===========================
policy                 routing CPU-s / 1k    a / b / c                  hit rate a / b, TTFT P90 c
=====================  ====================  =========================  ===========================
Envoy alone (rr)       1.47                  1.47 / 1.32 / 1.52         23% / 18%, 539 ms
Envoy + picker         8.63 (picker 5.18,    9.41 / 7.48 / 8.63         89% / 74.5%, 514 ms
 (default profile)     Envoy 3.24)
sglang-router          2.04                  2.13 / 1.68 / 2.12         89% / 75.6%, 855 ms
vllm-router            3.73                  3.73 / 2.84 / 3.73         89% / 75.6%, 876 ms
=====================  ====================  =========================  ===========================

The picker's idle rate: 0.030-0.036 cores at 8 simulated pods, 0.131 cores at 100 stand-in pods
(1,687 of 2,000 scrapes/s achieved on the busy machine). Target (issue 14): the picker above idle ≤
0.5 x sglang-router's whole proxy: 5.18 / 2.04 = 2.54, not met (5.1x the target). Envoy spends 2.2x
more CPU per request in front of the picker (3.24) than alone (1.47): the ext_proc messages, one
per streamed chunk among them. Routing quality is level with the peers on shared prefixes and
multi-turn (hit rates at the oracle's bound); without sharing, the peers' cache_aware (below its
match threshold) sends a request to the pod with the smallest prefix tree and weighs load only once
pods differ by more than 64 requests and 1.5x (their defaults), and their TTFT P90 is ~1.65x the
picker's. vllm-router renders every request on all 8 pods (8.0 token-id inputs per request, none
missing), which doubles the simulated pods' CPU in its runs.

Again with the picker on its own transport (epp.wire, its C read path for streamed chunks), at
5083721, on a machine whose wake-ups cost ~1.7x the one above (``bench/wakeup_floor.py``), 994 s:
routing CPU-s per 1,000 requests, medians: Envoy alone 2.91; Envoy + picker 10.99 (picker 5.55:
a / b / c 5.91 / 4.73 / 6.41; Envoy 5.03); sglang-router 3.42 (3.48 / 2.46 / 3.42); vllm-router
7.03. The target's ratio: 5.55 / 3.42 = **1.62** (2.54 on grpc.aio), 3.2x the target. Idle: 0.006-0.008
cores at 8 pods, 0.014 at 100 idle pods.

Where the picker's CPU per request goes (workload a alone, ``--workloads a --policies default
--rounds 1 --duration 40``, at f8ca4d5: 16 req/s, 6.6 CPU-s per 1k requests; ``/proc`` of both
processes and ``perf stat`` over 15 s of the load, ``py-spy record`` of the request process): the
request process ~4.1 ms a request, the scrape worker ~2.4. The request process is woken ~20 times a
request (4,759 context switches, 6,904 read/write/writev calls in 15 s: one wake-up per ext_proc
message, 16 streamed chunks among them) and spends two-thirds of its time in uvloop's C loop (epoll,
the reads and writes, the C chunk path) and a third in Python (HTTP/2 frames and HPACK ~11% of it
all, routing ~7%). The worker scraped 8 busy pods every 50 ms (160 scrapes a second), each pod in
its own phase slot, so one wake-up per scrape; their numbers change, so the idle backoff does not
slow them, and the idle rate subtracted is the backed-off one: the figures count the scraping that
busy pods cost, which the issue's "above its idle rate" meant to leave out when the idle rate was
full-cadence scraping. Since 168a464 a small pool shares one slot (``epp/datalayer/loops.py``):
the same measurement, that code and the one before alternating (the older picker from a checkout,
2 rounds each): scrape worker 1.63 / 1.71 ms a request against 2.74 / 3.01 before, request process
4.14 / 4.27 against 4.34 / 4.68.

The side-by-side run again at 168a464 (``--cpu-comparison --idle-pods 100``, 1,009 s; a busier
state of the machine: Envoy alone 3.18 CPU-s per 1k requests where it was 2.91): picker 5.67 (a / b
/ c 5.67 / 4.50 / 6.27), Envoy in front of it 5.65, sglang-router 4.14 (4.44 / 3.48 / 4.30),
vllm-router 8.17; the target's ratio **1.37** (1.62 at 5083721), 2.7x the target. Routing as
before: hit rates at the oracle's bound on a and b (approximate 98% on b), TTFT P90 on c 515 ms
against 864-914. Idle 0.004-0.006 cores at 8 pods, 0.016 at 100 idle pods.

With observed responses beside (``--cpu-comparison --policies rr,default,default+observe,sglang-router``, at
2931a94, 973 s), medians over every workload and round, routing CPU-s per 1,000 requests: picker 2.48 (a / b / c
2.73 / 1.67 / 2.48) processed and 2.48 (2.73 / 2.03 / 2.78) observed, Envoy in front of it 2.48 and 2.67,
sglang-router 1.89 (1.89 / 1.89 / 1.88): the target's ratio **1.31** either way, 2.6x the target. At 16 output
tokens a request, observing saves the picker little (16 chunks read, not answered) and adds a stream a request;
its saving is per chunk (``bench/streaming_cost.py --observe``). Routing the same: hit rates 100% of the oracle on
a, 98% on b (sglang-router 100%), TTFT P90 240 / 248 / 249 ms on a, 103 / 109 / 101 on b, 509 / 511 / 856 on c.

Again at b01342a, on a machine about twice as slow (sglang-router 3.76 where it was 1.89; a 10M-iteration Python
loop 2.2 s), ``--workloads a,b --policies default,default+observe,sglang-router --rounds 1 --duration 20``:
picker 4.72 processed, 4.79 observed (the request path 3.47 / 3.50, the scrape worker 1.45 / 1.48, idle not
subtracted), sglang-router 3.76: the ratio **1.26 / 1.27**. Where the picker's CPU went (workload a, default,
``--duration 60``; ``perf record -g -p`` of the request process for 10 s and ``py-spy record --native`` for 12 s,
its samples in ``poll``/``epoll_pwait`` left out): by library, the interpreter 57%, the kernel 21%, libc 6%,
uvloop 5.6%, numpy 4%, upb 3.5%, epp's C 1%, so Python's own work is most of it and the wake-ups (the kernel's
share, ~12 context switches a request at 16 requests a second) about a fifth: not the "two-thirds in uvloop's C
loop" read above from py-spy alone, which puts the callbacks' interpreter time under the loop's frame. Of the
request process's samples: the route 35% (the scheduler and its plugins 18%, the ``pre_request`` hooks, the
approximate index's add, 11%, the director's own 6%); the ext_proc messages and HTTP/2 frames around it 38%;
applying the scrape worker's results 8%; the loop's own C and the kernel 18%. The scrape worker
(160 scrapes a second of 8 busy pods, ``bench/scrape_cost.py --busy --pods 8``: 320-331 µs of CPU a scrape,
worker and request process together, on this machine) is two-thirds interpreter as well, its page reading 42% of
its Python samples. Reading observed connections once a 5 ms window (c27c6ec, reverted) made it worse: see
``epp/extproc/processor.py``.

What any picker pays: the ``floor`` policy beside them, ``--cpu-comparison --policies
rr,default,floor,sglang-router --rounds 2`` at 6a09d46 (691 s; sglang-router 3.64, a slow state of the
machine), medians over every workload and round, routing CPU-s per 1,000 requests: the picker 5.48 above
idle (a / b / c 5.63 / 3.82 / 6.08; its request path 4.01 and its scrape worker 1.78, idle not
subtracted), the no-work server **1.78** (1.88 / 1.42 / 1.86), sglang-router 3.64 (3.66 / 3.19 / 3.85);
Envoy 5.26 in front of the picker, 5.27 in front of the no-work server, 2.85 alone. The target's ratio:
the picker 1.51, the no-work server **0.49**. So the reference exchange's messages alone (the request's
headers and body, the response's headers, each of the 16 streamed chunks and the end, on epp's transport
with the chunks between the first and the last answered in C) cost what the target allows the whole
picker, and its own work would have to cost nothing: parsing, routing and accounting (2.23 above the
floor in the request path) and scraping (1.78: upstream's 50 ms cadence on 8 pods whose numbers change,
160 scrapes a second at this workload's 16 requests a second, ~10 a request; ``python bench/scrape_cost.py
--skip-latency --busy --pods 8 --rounds 2`` the same hour: 372 µs of CPU a scrape, worker and request process
together, of which reading the ~2 KB filtered page ~80-110 µs in a hot loop). What would go under it:
fewer messages (response body mode NONE, or observed responses: neither is what the gateways configure),
the exchange itself in native code (``bench/wakeup_floor.py``: a C epoll echo costs about half of a uvloop
one a message), and scraping priced by the requests rather than the clock.

The scrape cadence is upstream's flag, and the one part of that cost an operator can trade today:
``--cpu-comparison --policies "default,default+refresh-metrics-interval=200ms,floor,sglang-router"
--rounds 2`` at db054fd (724 s), medians over every workload and round: the picker 4.70 CPU-s per 1,000
requests above idle at 50 ms (its scrape worker 1.47), 3.54 at 200 ms (0.53), the no-work server 1.76,
sglang-router 3.22: the ratios 1.46, **1.10** and 0.55. What the slower cadence cost the routing, same
runs: workload a hit rate 88.7 against 89.0%, TTFT P90 253 against 237 ms (pod imbalance 1.43 against
1.33); b 72.6 against 74.0% (96 against 98% of the oracle), P90 115 ms both; c P90 513 ms both. Again
with 100 ms between, at 3e297e1 (569 s):
``--cpu-comparison --policies "default,default+refresh-metrics-interval=100ms,default+refresh-metrics-interval=200ms" --rounds 2``;
the picker 4.58 / 3.96 / 3.45 CPU-s per 1,000 requests at 50 / 100 / 200 ms (its scrape worker 1.43 / 0.93
/ 0.50); workload a's hit rate 89.0 / 88.9 / 88.7%, TTFT P90 244 / 251 / 256 ms; b's 73.4 / 73.4 / 72.7%,
P90 117 / 117 / 118 ms; c's P90 516 / 511 / 513 ms. So 100 ms saved the picker ~14% with no change in
routing these runs can see, 200 ms ~25% for about a point of b's hit rate and a few percent of a's P90.
Four rounds in two runs: a hint of the trade, not its measure; the default stays upstream's 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import heapq
import importlib.util
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np

from epp.envoy.bootstrap import BootstrapOptions, render, render_round_robin
from epp.sim.config import EngineConfig
from epp.sim.kvcache import BLOCK_SIZE, block_hashes, model_seed
from epp.sim.tokens import BYTES_PER_TOKEN, plan_output, render_chat
from epp.testing.envoy import EnvoyProcess, free_port
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker
from epp.testing.peers import KINDS as PEER_KINDS
from epp.testing.peers import POLICIES as PEER_POLICIES
from epp.testing.peers import PeerRouter, render_counts, unavailable
from epp.testing.peers import version as peer_version
from epp.testing.processes import stop_process

__all__ = [
    "POLICIES",
    "WORKLOADS",
    "Options",
    "Result",
    "Workload",
    "format_cpu_table",
    "format_table",
    "main",
    "make_workload",
    "median_results",
    "oracle_hit_rate",
    "routing_cpu_per_1k",
    "run",
    "write_chart",
]

_ROOT = Path(__file__).resolve().parent.parent
_QUEUE_KV_CONFIG = _ROOT / "deploy" / "config" / "queue-kv-only.yaml"
_COST = EngineConfig()  # the simulator's default cost model, which the child process also uses
MODEL = _COST.model

WORKLOADS = {"a": "shared prefix", "b": "multi-turn chat", "c": "no sharing"}
POLICIES = {
    "rr": "round robin",
    "queue-kv": "queue + KV",
    "default": "prefix + queue + KV",
    "floor": "no-work ext_proc",
    "sglang-router": "sglang-router",
    "vllm-router": "vllm-router",
}
_PEER_POLICY = "cache_aware"  # the peers' prefix-aware policy; KIND:POLICY picks another
_NOT_PICKERS = ("rr", "floor")  # Envoy alone, and a no-work ext_proc server: neither runs the picker

# Workload shapes (tokens); see the module docstring.
_SYSTEM_TOKENS = (2048, 6144)
_QUESTION_TOKENS = (16, 64)
_SESSION_SYSTEM_TOKENS = (256, 1024)
_SESSION_MESSAGE_TOKENS = (64, 512)
_SESSION_TURNS = (3, 8)
_THINK_MEAN_S = 0.5  # simulated seconds between an answer and the next turn
_PILOT_ITEMS = 64  # items generated to estimate the mean request cost before the rate is fixed
_REQUEST_TIMEOUT_S = 120.0
_SETTLE_S = 0.5  # after Envoy admits the picker: ten scrape rounds at the default 50 ms interval


# -- workloads ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: the chat messages to send, and what the simulator will do with them."""

    messages: tuple[tuple[str, str], ...]
    prompt_tokens: int  # in the simulator's tokens, chat template included
    answer: str  # the text the simulator will generate (deterministic)


@dataclass(frozen=True, slots=True)
class Item:
    """What arrives at once: one request, or a session whose turns follow each other."""

    family: str | None  # prefix family (group or session) for the stickiness diagnostic
    turns: tuple[Turn, ...]
    think_s: tuple[float, ...]  # simulated seconds before each turn after the first
    at_s: float = 0.0  # simulated arrival time (open loop)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    items: tuple[Item, ...]
    rate_per_s: float  # requests per simulated second offered (open loop)
    capacity_per_s: float  # the pool's requests per simulated second with no cache hit
    prefix_working_set_tokens: int = 0

    @property
    def requests(self) -> int:
        return sum(len(item.turns) for item in self.items)


def _text(rng: np.random.Generator, tokens: int) -> str:
    """``tokens`` random 4-byte words (three letters and a space): one simulator token each."""
    letters = rng.integers(97, 123, size=(tokens, BYTES_PER_TOKEN), dtype=np.uint8)
    letters[:, -1] = 32
    return letters.tobytes().decode("ascii")


def _turn(messages: tuple[tuple[str, str], ...], max_tokens: int, seed: int) -> Turn:
    prompt = render_chat(messages)
    plan = plan_output(
        prompt,
        model=MODEL,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
        mean_output_tokens=_COST.mean_output_tokens,
    )
    return Turn(messages, len(prompt), "".join(plan.words))


def _cost_s(turn: Turn, max_tokens: int) -> float:
    """Simulated GPU seconds of a request with no cache hit (step base left out: it is shared by a batch)."""
    c = _COST
    context = turn.prompt_tokens + max_tokens / 2
    return turn.prompt_tokens * c.prefill_token_s + max_tokens * (c.decode_seq_s + c.kv_read_token_s * context)


def _group_prompts(rng: np.random.Generator, groups: int) -> list[str]:
    return [_text(rng, int(rng.integers(*_SYSTEM_TOKENS, endpoint=True))) for _ in range(groups)]


def _items(kind: str, rng: np.random.Generator, opts: Options, group_prompts: list[str]) -> Iterator[Item]:
    sim_seed, max_tokens = opts.seed, opts.max_tokens
    if kind == "a":
        if opts.popularity == "zipf":
            weights = 1.0 / np.arange(1, len(group_prompts) + 1) ** opts.zipf_s
            p = weights / weights.sum()
        else:
            p = None
        while True:
            g = int(rng.choice(len(group_prompts), p=p))
            question = _text(rng, int(rng.integers(*_QUESTION_TOKENS, endpoint=True)))
            turn = _turn((("system", group_prompts[g]), ("user", question)), max_tokens, sim_seed)
            yield Item(f"group-{g}", (turn,), ())
    elif kind == "b":
        session = 0
        while True:
            history: tuple[tuple[str, str], ...] = (
                ("system", _text(rng, int(rng.integers(*_SESSION_SYSTEM_TOKENS, endpoint=True)))),
            )
            turns = []
            for _ in range(int(rng.integers(*_SESSION_TURNS, endpoint=True))):
                history += (("user", _text(rng, int(rng.integers(*_SESSION_MESSAGE_TOKENS, endpoint=True)))),)
                turn = _turn(history, max_tokens, sim_seed)
                turns.append(turn)
                history += (("assistant", turn.answer),)
            think = tuple(float(x) for x in rng.exponential(_THINK_MEAN_S, size=len(turns) - 1))
            yield Item(f"session-{session}", tuple(turns), think)
            session += 1
    elif kind == "c":
        while True:
            text = _text(rng, int(rng.integers(*_SYSTEM_TOKENS, endpoint=True)) + int(rng.integers(*_QUESTION_TOKENS)))
            yield Item(None, (_turn((("user", text),), max_tokens, sim_seed),), ())
    else:
        raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")


def make_workload(kind: str, opts: Options) -> Workload:
    """The trace of workload ``kind`` for ``opts``: items with Poisson arrival times, sized so that the
    arrivals span ``opts.duration`` wall seconds at ``opts.load`` of the no-hit capacity."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")
    group_prompts = _group_prompts(np.random.default_rng([opts.seed, 0]), opts.groups)
    rng = np.random.default_rng([opts.seed, 1 + list(WORKLOADS).index(kind)])
    source = _items(kind, rng, opts, group_prompts)
    items = [next(source) for _ in range(_PILOT_ITEMS)]
    turns = [t for item in items for t in item.turns]
    mean_cost = sum(_cost_s(t, opts.max_tokens) for t in turns) / len(turns)
    capacity = opts.pods / mean_cost
    rate = opts.load * capacity  # requests per simulated second
    turns_per_item = len(turns) / len(items)
    span_s = opts.duration / opts.time_scale
    n_items = max(1, round(rate / turns_per_item * span_s))
    while len(items) < n_items:
        items.append(next(source))
    items = items[:n_items]
    gaps = np.random.default_rng([opts.seed, 99]).exponential(turns_per_item / rate, size=n_items)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first item arrives at once
    items = [Item(i.family, i.turns, i.think_s, float(at)) for i, at in zip(items, arrivals, strict=True)]
    working_set = sum(len(p) // BYTES_PER_TOKEN for p in group_prompts)
    return Workload(kind, tuple(items), rate, capacity, working_set)


def _oracle_trace(workload: Workload, seed: int, block_size: int) -> Iterator[tuple[int, int, list[int], int]]:
    """Per turn, in trace order: (item index, prompt tokens, block hashes, how many blocks it looks up)."""
    chain_seed = model_seed(MODEL)
    for i, item in enumerate(workload.items):
        for turn in item.turns:
            prompt = render_chat(turn.messages)
            plan = plan_output(
                prompt,
                model=MODEL,
                seed=seed,
                max_tokens=len(turn.answer) // BYTES_PER_TOKEN,
                ignore_eos=True,
                mean_output_tokens=_COST.mean_output_tokens,
            )
            hashes = block_hashes(np.concatenate((prompt, plan.token_ids)), chain_seed, block_size).tolist()
            # the blocks it stores: prompt and output but the last output token (whose KV is never computed)
            stored = hashes[: (len(prompt) + len(plan.token_ids) - 1) // block_size]
            yield i, len(prompt), stored, min(len(stored), (len(prompt) - 1) // block_size)


def oracle_hit_rate(workload: Workload, *, seed: int, block_size: int = BLOCK_SIZE, skip: Container[int] = ()) -> float:
    """The hit rate with one unlimited cache shared by every request, in trace order (module docstring).

    Items whose index is in ``skip`` fill the cache but are not counted (requests that bypass the gateway)."""
    return finite_hit_rate(workload, None, seed=seed, block_size=block_size, skip=skip)


def finite_hit_rate(
    workload: Workload,
    capacity: int | None,
    *,
    seed: int,
    policy: str = "lru",
    block_size: int = BLOCK_SIZE,
    skip: Container[int] = (),
) -> float:
    """The oracle's hit rate with its one shared cache bounded to ``capacity`` blocks (the pool's total;
    None: unbounded, the oracle itself).

    ``policy``: ``"lru"`` evicts the least recently used block (what one pod with the whole pool's
    memory would do: vLLM's eviction is LRU); ``"min"`` evicts the block whose next use is farthest
    (Belady's MIN, optimal for a cache of single blocks; with prefix hits, where a block is worth
    something only behind its parents, a close reference rather than a strict bound). Either way no
    routing over several pods does better than a shared cache of their total size would have, except
    by luck of eviction order: the unlimited oracle says what the trace offers, this what the pool's
    memory can hold of it."""
    trace = list(_oracle_trace(workload, seed, block_size))
    uses: dict[int, list[int]] = {}
    if policy == "min":
        for t, (_, _, stored, looked_up) in enumerate(trace):
            for h in stored[:looked_up]:
                uses.setdefault(h, []).append(t)
    elif policy != "lru":
        raise ValueError(f"unknown policy {policy!r}")
    never = len(trace)

    def next_use(h: int, t: int) -> int:
        times = uses.get(h)
        if not times:
            return never
        k = bisect.bisect_right(times, t)
        return times[k] if k < len(times) else never

    cache: OrderedDict[int, None] = OrderedDict()  # least recently used first
    farthest: list[tuple[int, int]] = []  # MIN: (-next use, block), stale entries skipped
    due: dict[int, int] = {}
    hits = queries = 0
    for t, (i, prompt_tokens, stored, looked_up) in enumerate(trace):
        n = 0
        for h in stored[:looked_up]:
            if h not in cache:
                break
            cache.move_to_end(h)  # the blocks it hits are held while it runs: its own allocations cannot evict them
            n += 1
        if i not in skip:
            hits += n * block_size
            queries += prompt_tokens
        for h in stored:
            if h not in cache:
                if capacity is not None and len(cache) >= capacity:
                    if policy == "lru":
                        cache.popitem(last=False)
                    else:
                        while True:
                            when, victim = heapq.heappop(farthest)
                            if victim in cache and due.get(victim) == -when:
                                break
                        del cache[victim], due[victim]
                cache[h] = None
            if policy == "min":
                due[h] = next_use(h, t)
                heapq.heappush(farthest, (-due[h], h))
        for h in reversed(stored):  # freed tail first, as vLLM frees a request's blocks: its tail goes first
            if h in cache:  # (a request longer than the cache evicted its own first blocks)
                cache.move_to_end(h)
    return hits / queries if queries else 0.0


def knowing_router_hit_rate(
    workload: Workload,
    pods: int,
    capacity: int,
    *,
    seed: int,
    block_size: int = BLOCK_SIZE,
    skip: Container[int] = (),
) -> float:
    """The hit rate of a router that knows every pod's cache: ``pods`` caches of ``capacity`` blocks each
    (LRU, as a pod evicts), requests in trace order, each sent to the pod holding the longest run of its
    leading blocks (a tie to the pod sent the fewest requests so far), whose cache it then fills as
    :func:`finite_hit_rate`'s does. The reference for routing under cache pressure, where the unlimited
    oracle asks for memory no pool has: what perfect knowledge of the pods' caches buys a greedy router.
    Not a bound: one request at a time (no two in flight), and greedy (a router that spread prefixes
    on purpose could keep more: :func:`placed_hit_rate`). Items in ``skip`` are routed the same way but
    not counted."""

    def greedy(item: int, runs: list[int], sent: list[int]) -> int:
        return max(range(pods), key=lambda k: (runs[k], -sent[k]))

    trace = _oracle_trace(workload, seed, block_size)
    return _routed_hit_rate(trace, pods, capacity, greedy, block_size=block_size, skip=skip)


def placed_hit_rate(
    workload: Workload,
    pods: int,
    capacity: int,
    *,
    seed: int,
    block_size: int = BLOCK_SIZE,
    skip: Container[int] = (),
) -> float:
    """The hit rate of a static placement chosen knowing the whole trace: each family (a system prompt's
    group, a session) on one pod, whatever the pods hold, the families placed largest first (their
    prompt blocks times their requests) on the pod with the fewest prompt blocks placed so far; the
    pods' caches as :func:`knowing_router_hit_rate`'s. What spreading prefixes on purpose keeps under
    cache pressure: each prefix cached on one pod only, and the pods' shares of the prefixes even.
    Items without a family are sent round robin."""
    trace = list(_oracle_trace(workload, seed, block_size))
    blocks: dict[str, int] = {}
    requests: Counter[str] = Counter()
    for i, _, _, looked_up in trace:
        family = workload.items[i].family
        if family is not None:
            blocks[family] = max(blocks.get(family, 0), looked_up)
            requests[family] += 1
    placed = [0] * pods
    place: dict[str, int] = {}
    for family in sorted(blocks, key=lambda f: (-blocks[f] * requests[f], f)):
        pod = min(range(pods), key=lambda k: (placed[k], k))
        place[family] = pod
        placed[pod] += blocks[family]
    unplaced = itertools.count()

    def static(item: int, runs: list[int], sent: list[int]) -> int:
        family = workload.items[item].family
        return place[family] if family is not None else next(unplaced) % pods

    return _routed_hit_rate(trace, pods, capacity, static, block_size=block_size, skip=skip)


def _routed_hit_rate(
    trace: Iterable[tuple[int, int, list[int], int]],
    pods: int,
    capacity: int,
    choose: Callable[[int, list[int], list[int]], int],
    *,
    block_size: int,
    skip: Container[int],
) -> float:
    """``pods`` LRU caches of ``capacity`` blocks, the requests of ``trace`` (:func:`_oracle_trace`'s) in
    order, each sent to the pod ``choose(item index, each pod's run of the request's leading blocks,
    requests sent to each)`` names."""
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(pods)]
    sent = [0] * pods
    hits = queries = 0
    for i, prompt_tokens, stored, looked_up in trace:
        runs = []
        for cache in caches:
            n = 0
            for h in stored[:looked_up]:
                if h not in cache:
                    break
                n += 1
            runs.append(n)
        pod = choose(i, runs, sent)
        sent[pod] += 1
        cache = caches[pod]
        for h in stored[: runs[pod]]:
            cache.move_to_end(h)
        if i not in skip:
            hits += runs[pod] * block_size
            queries += prompt_tokens
        for h in stored:
            if h not in cache:
                if len(cache) >= capacity:
                    cache.popitem(last=False)
                cache[h] = None
        for h in reversed(stored):
            if h in cache:
                cache.move_to_end(h)
    return hits / queries if queries else 0.0


# -- the client --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Record:
    family: str | None
    sent: float  # loop time
    lag: float  # how late it was sent (open loop)
    status: int = 0
    pod: str = ""
    ttft: float | None = None
    done: float | None = None
    tokens: int = 0
    answer_ok: bool = True
    error: str = ""
    held: tuple[int, int] | None = None  # prompt tokens the chosen pod, and the best pod, held at arrival


_decode = msgspec.json.Decoder()


async def _send(session: aiohttp.ClientSession, url: str, turn: Turn, record: Record, max_tokens: int) -> bool:
    body = {
        "model": MODEL,
        "messages": [{"role": r, "content": c} for r, c in turn.messages],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    try:
        async with session.post(
            url, data=msgspec.json.encode(body), headers={"content-type": "application/json"}
        ) as resp:
            record.status = resp.status
            record.pod = resp.headers.get("x-sim-pod", "")
            held = resp.headers.get("x-sim-held-at-arrival")
            if held:
                own, best = held.split()
                record.held = (int(own), int(best))
            if resp.status != 200:
                record.error = (await resp.text())[:200]
                return False
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = _decode.decode(line[6:])
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        if record.ttft is None:
                            record.ttft = time.perf_counter() - record.sent
                        parts.append(content)
                usage = chunk.get("usage")
                if usage:
                    record.tokens = int(usage.get("completion_tokens", 0))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return False
    record.done = time.perf_counter()
    record.answer_ok = "".join(parts) == turn.answer
    return record.ttft is not None


async def _run_item(
    session: aiohttp.ClientSession, url: str, item: Item, records: list[Record], opts: Options, scheduled: float
) -> None:
    for i, turn in enumerate(item.turns):
        if i:
            await asyncio.sleep(item.think_s[i - 1] * opts.time_scale)
        now = time.perf_counter()
        record = Record(item.family, now, max(0.0, now - scheduled) if i == 0 else 0.0)
        records.append(record)
        if not await _send(session, url, turn, record, opts.max_tokens):
            return  # the rest of a session makes no sense without this answer


async def _drive(url: str, workload: Workload, opts: Options) -> tuple[list[Record], int]:
    """Send the workload through ``url``; returns the records and how many items were cut off by the time
    bound (never started, or still running)."""
    records: list[Record] = []
    finished = 0
    endpoint = url + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    deadline = time.perf_counter() + opts.duration + opts.drain

    async def one(item: Item, scheduled: float) -> None:
        nonlocal finished
        await _run_item(session, endpoint, item, records, opts, scheduled)
        finished += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: list[asyncio.Task[None]] = []
        if opts.users:
            queue = iter(workload.items)

            async def user() -> None:
                for item in queue:
                    await one(item, time.perf_counter())

            tasks = [asyncio.create_task(user()) for _ in range(opts.users)]
        else:
            t0 = time.perf_counter()
            for item in workload.items:
                at = t0 + item.at_s * opts.time_scale
                delay = at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(item, at)))
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records, len(workload.items) - finished


# -- one policy on one workload ----------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    policy: str
    requests: int  # requests sent
    completed: int
    errors: int
    unfinished: int  # items (requests, or sessions for b) cut off by the time bound
    hit_rate: float
    oracle_hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    req_per_s: float
    tokens_per_s: float
    cpu_cores: dict[str, float] = field(default_factory=dict)  # each process's CPU during the load / wall
    stickiness: float | None = None
    imbalance: float = 0.0
    preemptions: int = 0
    lag_p99_ms: float = 0.0
    wrong_answers: int = 0
    wall_s: float = 0.0
    first_error: str = ""
    round: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)  # each process's CPU-seconds during the load
    idle_cores: dict[str, float] = field(default_factory=dict)  # picker and Envoy before the load, no traffic
    router_stats: dict[str, float] = field(default_factory=dict)  # vllm-router: token-id inputs, decisions
    # Prompt tokens the chosen pods held at each request's arrival, as a share of what the best pod of
    # the pool held then (the simulator's x-sim-held-at-arrival): the routing alone, at each decision.
    held_share: float | None = None


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


_COUNTER = re.compile(
    rb"^(vllm:prefix_cache_queries_total|vllm:prefix_cache_hits_total|vllm:num_preemptions_total)"
    rb"(?:\{[^}]*\})? ([0-9.eE+-]+)$",
    re.M,
)


async def _sim_counters(pods: Sequence[str]) -> Counter[str]:
    totals: Counter[str] = Counter()
    query = "&".join(
        f"name[]={n}"
        for n in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total")
    )
    async with aiohttp.ClientSession() as session:
        for pod in pods:
            async with session.get(f"http://{pod}/metrics?{query}") as resp:
                page = await resp.read()
            for name, value in _COUNTER.findall(page):
                totals[name.decode()] += float(value)
    return totals


class _Simulator:
    """``python -m epp.sim`` as a child process, with the render endpoints vllm-router's cache_aware
    asks for token ids (``--enable-scale-out``; they change nothing else). Its stderr goes to a file,
    shown if it fails: sglang-router probes each pod for gRPC at start, which aiohttp logs as a bad
    request with a traceback."""

    def __init__(self, opts: Options, num_gpu_blocks: int) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "epp.sim",
                "--pods",
                str(opts.pods),
                "--seed",
                str(opts.seed),
                "--time-scale",
                str(opts.time_scale),
                "--num-gpu-blocks",
                str(num_gpu_blocks),
                "--max-model-len",
                str(num_gpu_blocks * BLOCK_SIZE),
                "--enable-scale-out",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        assert self.process.stdout is not None
        self.pods = []
        for _ in range(opts.pods):
            line = self.process.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"the simulator exited with status {self.process.wait()}:\n{self.stderr_tail()}")
            self.pods.append(line.split()[1].removeprefix("http://"))

    def stderr_tail(self, chars: int = 4000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def stop(self) -> None:
        stop_process(self.process)
        self._stderr.close()


def num_gpu_blocks(opts: Options) -> int:
    """KV blocks per simulated pod: ``opts.num_gpu_blocks``, or ``cache_fraction`` of workload a's prefixes."""
    if opts.num_gpu_blocks:
        return opts.num_gpu_blocks
    group_prompts = _group_prompts(np.random.default_rng([opts.seed, 0]), opts.groups)
    working_set_blocks = sum(len(p) // BYTES_PER_TOKEN for p in group_prompts) // BLOCK_SIZE
    # At least room for the longest chat session of workload b and some concurrency.
    return max(1024, round(opts.cache_fraction * working_set_blocks))


_OBSERVE = "observe"  # +observe: the picker behind an Envoy that observes responses (--observe-responses)


def _picker_flags(policy: str) -> tuple[str, list[str]]:
    """A picker policy and the extra flags it names: ``default+io-thread=false`` -> (default, [--io-thread=false]).
    ``+observe`` is Envoy's, not the picker's (:func:`_observes`)."""
    base, *flags = policy.partition("@")[0].split("+")
    return base, [f"--{flag}" for flag in flags if flag != _OBSERVE]


def _observes(policy: str) -> bool:
    """Whether a picker policy's Envoy observes responses (``default+observe``: ``epp envoy-config
    --observe-responses``): the picker's filter skips the response, a second one sends it unanswered."""
    return _OBSERVE in policy.partition("@")[0].split("+")[1:]


def _picker_python(policy: str) -> str:
    """The interpreter a picker policy runs under: ``default@PATH`` names one (a wrapper that puts another
    checkout first, to run two pickers side by side), else this one."""
    return policy.partition("@")[2] or sys.executable


def _peer(policy: str) -> tuple[str, str] | None:
    """(router kind, its policy) for a peer policy (``sglang-router``, ``vllm-router:round_robin``), else None."""
    kind, _, peer_policy = policy.partition(":")
    return (kind, peer_policy or _PEER_POLICY) if kind in PEER_KINDS else None


def run_policy(
    workload: Workload, policy: str, opts: Options, oracle: float, blocks: int, *, round_: int = 0
) -> Result:
    """Start a cold simulator, the policy's gateway, send the workload, and measure."""
    _check_policy(policy)
    sim = _Simulator(opts, blocks)
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    router: PeerRouter | None = None
    floor: _FloorPicker | None = None
    idle: dict[str, float] = {}
    stats: dict[str, float] = {}
    try:
        peer = _peer(policy)
        pids = {"simulator": sim.process.pid}
        if peer is not None:
            # The client talks to the router, which proxies to the pods itself: no Envoy.
            router = PeerRouter.start(peer[0], sim.pods, policy=peer[1])
            url = router.url
            pids[peer[0]] = router.pid
        else:
            if policy == "rr":
                bootstrap = render_round_robin(
                    BootstrapOptions(
                        listen_address="127.0.0.1", listen_port=0, admin_port=0, pool_endpoints=tuple(sim.pods)
                    )
                )
            elif policy == "floor":
                floor = _FloorPicker(sim.pods)
                bootstrap = render(
                    BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, picker_port=floor.port)
                )
            else:
                base, flags = _picker_flags(policy)
                config = _QUEUE_KV_CONFIG if base == "queue-kv" else base.removeprefix("config:")
                extra = (["--config-file", str(config)] if base != "default" else []) + flags
                picker = PickerProcess(sim.pods, extra_args=extra, python=_picker_python(policy))
                picker.start()
                bootstrap = render(
                    BootstrapOptions(
                        listen_address="127.0.0.1",
                        listen_port=0,
                        admin_port=0,
                        picker_port=picker.grpc_port,
                        observe_responses=_observes(policy),
                    )
                )
            envoy = EnvoyProcess(bootstrap, concurrency=1)
            envoy.start()
            url = f"http://127.0.0.1:{envoy.listen_port}"
            pids["envoy"] = envoy.pid
            ext_proc = picker or floor
            if ext_proc is not None:
                wait_for_picker(envoy)
                time.sleep(_SETTLE_S)
                pids["picker"] = ext_proc.pid
                # The picker's idle rate (scraping every pod, no traffic), on this very pool, subtracted below.
                idle = _idle_cores({"picker": ext_proc.pid, "envoy": envoy.pid}, opts.idle_window)
        before = asyncio.run(_sim_counters(sim.pods))
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        if "picker" in pids:  # its request-path process alone (the rest is its scrape worker)
            cpu0[_PICKER_MAIN] = cpu_seconds(pids["picker"], children=False)
        client0 = time.process_time()
        wall0 = time.perf_counter()
        records, unfinished = _run_loop(_drive(url, workload, opts))
        wall = time.perf_counter() - wall0
        cpu_s = {name: cpu_seconds(pid) - cpu0[name] for name, pid in pids.items()}
        if "picker" in pids:
            cpu_s[_PICKER_MAIN] = cpu_seconds(pids["picker"], children=False) - cpu0[_PICKER_MAIN]
        cpu_s["client"] = time.process_time() - client0
        after = asyncio.run(_sim_counters(sim.pods))
        if router is not None and router.kind == "vllm-router":
            stats = render_counts(router.metrics())
    finally:
        if router is not None:
            router.stop()
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
            with contextlib.suppress(OSError):
                os.unlink(picker.log_path)
        if floor is not None:
            floor.stop()
        sim.stop()
    result = _summarise(
        workload, policy, records, unfinished, before, after, {k: v / wall for k, v in cpu_s.items()}, oracle, wall
    )
    return dataclasses.replace(
        result,
        round=round_,
        cpu_s={k: round(v, 3) for k, v in cpu_s.items()},
        idle_cores={k: round(v, 4) for k, v in idle.items()},
        router_stats=stats,
    )


class _FloorPicker:
    """``bench/passthrough_picker.py`` serving the pool round robin: the reference ext_proc exchange on epp's
    transport with no work (no parsing, routing, accounting or scraping), the policy ``floor``. Its CPU beside
    the picker's is what the protocol's messages cost any picker; the rest is the picker's own."""

    def __init__(self, pods: Sequence[str]) -> None:
        self.port = free_port()
        script = Path(__file__).with_name("passthrough_picker.py")
        self.process = subprocess.Popen(
            [sys.executable, str(script), "--port", str(self.port), "--endpoints", ",".join(pods)]
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        stop_process(self.process)


def _idle_cores(pids: dict[str, int], window: float) -> dict[str, float]:
    """Each process's CPU per wall second over ``window`` seconds of no traffic."""
    cpu0, t0 = {name: cpu_seconds(pid) for name, pid in pids.items()}, time.perf_counter()
    time.sleep(window)
    elapsed = time.perf_counter() - t0
    return {name: (cpu_seconds(pid) - cpu0[name]) / elapsed for name, pid in pids.items()}


_ROUTING = ("picker", "envoy", *PEER_KINDS)  # the processes that route (the pods and the client do not)
_PICKER_MAIN = "picker request path"  # the picker's own process, its scrape worker left out (a part of "picker")


def routing_cpu_per_1k(r: Result) -> dict[str, float]:
    """CPU-seconds per 1,000 completed requests of each routing process of ``r``: the picker's above
    its idle rate (idle cores x the load's wall time subtracted), Envoy's and a peer router's whole."""
    if not r.completed:
        return {}
    per = {}
    for name in _ROUTING:
        if name in r.cpu_s:
            used = r.cpu_s[name] - (r.idle_cores.get(name, 0.0) * r.wall_s if name == "picker" else 0.0)
            per[name] = used / r.completed * 1000
    return per


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _summarise(
    workload: Workload,
    policy: str,
    records: list[Record],
    unfinished: int,
    before: Counter[str],
    after: Counter[str],
    cpu: dict[str, float],
    oracle: float,
    wall: float,
) -> Result:
    done = [r for r in records if r.done is not None and r.ttft is not None]
    ttfts = [r.ttft * 1000 for r in done if r.ttft is not None]
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    span = (max(r.done for r in done if r.done is not None) - min(r.sent for r in records)) if done else math.nan
    # Stickiness: of the requests of a family after its first, how many went where the previous one did.
    last: dict[str, str] = {}
    same = repeats = 0
    for r in sorted(records, key=lambda r: r.sent):
        if r.family is None or not r.pod:
            continue
        if r.family in last:
            repeats += 1
            same += last[r.family] == r.pod
        last[r.family] = r.pod
    per_pod = Counter(r.pod for r in records if r.pod)
    best_held = sum(r.held[1] for r in done if r.held)
    return Result(
        workload=workload.name,
        policy=policy,
        requests=len(records),
        completed=len(done),
        errors=sum(1 for r in records if r.error),
        unfinished=unfinished,
        hit_rate=hits / queries if queries else 0.0,
        oracle_hit_rate=oracle,
        ttft_p50_ms=_percentile(ttfts, 50),
        ttft_p90_ms=_percentile(ttfts, 90),
        req_per_s=len(done) / span if done else 0.0,
        tokens_per_s=sum(r.tokens for r in done) / span if done else 0.0,
        cpu_cores={k: round(v, 3) for k, v in cpu.items()},
        stickiness=same / repeats if repeats else None,
        imbalance=max(per_pod.values()) / (sum(per_pod.values()) / len(per_pod)) if per_pod else 0.0,
        preemptions=int(after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]),
        lag_p99_ms=_percentile([r.lag * 1000 for r in records], 99),
        wrong_answers=sum(1 for r in done if not r.answer_ok),
        wall_s=wall,
        first_error=next((f"{r.status}: {r.error}" for r in records if r.error), ""),
        held_share=sum(r.held[0] for r in done if r.held) / best_held if best_held else None,
    )


# -- the whole run -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    pods: int = 8
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    policies: tuple[str, ...] = ("rr", "queue-kv", "default")  # the peers when asked (they install apart)
    duration: float = 30.0  # wall seconds of arrivals per (workload, policy)
    drain: float = 30.0  # wall seconds after that before unfinished requests are cut off
    load: float = 0.7
    users: int = 0  # closed loop with this many users; 0 = open loop
    time_scale: float = 2.0
    groups: int = 32
    popularity: str = "uniform"
    zipf_s: float = 1.0
    max_tokens: int = 16
    cache_fraction: float = 0.25
    num_gpu_blocks: int = 0
    seed: int = 1
    rounds: int = 1  # each round runs every workload x policy once; policies alternate within a round
    idle_window: float = 5.0  # wall seconds of the picker's idle rate, measured before each load

    def __post_init__(self) -> None:
        for name in ("pods", "groups", "max_tokens", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("duration", "time_scale", "load", "cache_fraction", "zipf_s", "idle_window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.drain < 0 or self.users < 0 or self.num_gpu_blocks < 0:
            raise ValueError("drain, users and num_gpu_blocks cannot be negative")
        if self.popularity not in ("uniform", "zipf"):
            raise ValueError("popularity must be uniform or zipf")
        for w in self.workloads:
            if w not in WORKLOADS:
                raise ValueError(f"unknown workload {w!r}: choose from {', '.join(WORKLOADS)}")
        for p in self.policies:
            _check_policy(p)


def _check_policy(policy: str) -> None:
    peer = _peer(policy)
    if peer is None:
        whole, policy = policy, _picker_flags(policy)[0]
        if policy in _NOT_PICKERS and whole != policy:
            raise ValueError(f"policy {whole!r}: {policy} runs no picker, so it takes no +FLAG, +observe or @PYTHON")
    if policy.startswith("config:"):
        if not Path(policy.removeprefix("config:")).is_file():
            raise ValueError(f"policy {policy!r}: no such file")
    elif peer is not None:
        if peer[1] not in PEER_POLICIES[peer[0]]:
            raise ValueError(f"policy {policy!r}: {peer[0]} policies are {', '.join(PEER_POLICIES[peer[0]])}")
    elif policy not in POLICIES:
        raise ValueError(
            f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}, "
            f"{'|'.join(PEER_KINDS)}:POLICY or config:PATH"
        )


def _label(policy: str) -> str:
    peer = _peer(policy)
    if peer is not None:
        return peer[0] if peer[1] == _PEER_POLICY else f"{peer[0]} {peer[1]}"
    base, _, python = policy.partition("@")
    label = POLICIES.get(base) or Path(base.removeprefix("config:")).stem
    return f"{label} @{Path(python).name}" if python else label


def run(opts: Options, *, log: Any = print) -> list[Result]:
    """Every policy on every workload, ``opts.rounds`` times; one :class:`Result` per run, in run order.

    Within a round the policies alternate on each workload (the same trace), and each round starts the
    policy list one further along, so that no policy always runs first on a machine whose load drifts."""
    for policy in opts.policies:
        peer = _peer(policy)
        if peer is not None and (why := unavailable(peer[0])) is not None:
            raise RuntimeError(f"policy {policy}: {why}")
    blocks = num_gpu_blocks(opts)
    log(
        f"pool: {opts.pods} simulated pods, {blocks} KV blocks ({blocks * BLOCK_SIZE} tokens) each, "
        f"time scale {opts.time_scale}; load: "
        + (
            f"closed loop, {opts.users} users"
            if opts.users
            else f"open loop, Poisson, {opts.load:.0%} of no-hit capacity"
        )
        + f"; {opts.max_tokens} output tokens per request"
    )
    peers = sorted({p[0] for p in map(_peer, opts.policies) if p is not None})
    if peers:
        log("peers: " + ", ".join(f"{kind} {peer_version(kind)}" for kind in peers))
    workloads = []
    for kind in opts.workloads:
        workload = make_workload(kind, opts)
        longest = max(t.prompt_tokens for item in workload.items for t in item.turns) + opts.max_tokens
        if longest > blocks * BLOCK_SIZE:
            raise ValueError(
                f"workload {kind} has a request of {longest} tokens: more than a pod's KV cache "
                f"({blocks} blocks of {BLOCK_SIZE}); give more --num-gpu-blocks"
            )
        oracle = oracle_hit_rate(workload, seed=opts.seed)
        log(
            f"workload {kind} ({WORKLOADS[kind]}): {len(workload.items)} items, {workload.requests} requests, "
            f"{workload.rate_per_s / opts.time_scale:.1f} req/s wall offered "
            f"(no-hit capacity {workload.capacity_per_s / opts.time_scale:.1f}), oracle hit rate {oracle:.1%}"
        )
        workloads.append((workload, oracle))
    results = []
    for round_ in range(opts.rounds):
        if opts.rounds > 1:
            log(f"round {round_ + 1} of {opts.rounds}")
        shift = round_ % len(opts.policies)
        policies = opts.policies[shift:] + opts.policies[:shift]
        for workload, oracle in workloads:
            for policy in policies:
                result = run_policy(workload, policy, opts, oracle, blocks, round_=round_)
                log(
                    f"  {workload.name} {policy:<13} {result.wall_s:3.0f}s: hit {result.hit_rate:.1%}, TTFT P90 "
                    f"{result.ttft_p90_ms:.0f} ms; CPU-s per 1k requests "
                    + (", ".join(f"{k} {v:.2f}" for k, v in routing_cpu_per_1k(result).items()) or "-")
                    + (
                        f" (picker idle {result.idle_cores['picker']:.3f} cores)"
                        if "picker" in result.idle_cores
                        else ""
                    )
                    + "; cores "
                    + ", ".join(f"{k} {v:.2f}" for k, v in result.cpu_cores.items())
                )
                if result.router_stats:
                    log(
                        "    vllm-router: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(result.router_stats.items()))
                        + f" ({result.router_stats.get('input:render', 0) / max(result.requests, 1):.1f} renders "
                        "per request: input:render counts token ids received from a pod)"
                    )
                if (warning := _router_warning(result)) is not None:
                    log(f"  warning: {warning}")
                results.append(result)
    return results


def _router_warning(r: Result) -> str | None:
    """vllm-router's cache_aware without token ids from the pods routes blind: say so."""
    if _peer(r.policy) != ("vllm-router", _PEER_POLICY):
        return None
    missing = r.router_stats.get("decision:missing_tokens", 0.0)
    if missing or not r.router_stats.get("input:render", 0.0):
        return (
            f"{r.workload}/{r.policy}: vllm-router routed {missing:.0f} requests without token ids "
            f"(inputs {r.router_stats}): are the pods' render endpoints on (--enable-scale-out)?"
        )
    return None


_SUMMED = ("requests", "completed", "errors", "unfinished", "preemptions", "wrong_answers")


def median_results(results: Sequence[Result]) -> list[Result]:
    """One :class:`Result` per (workload, policy), in first-seen order: the median over its rounds of
    every measured figure (each CPU entry apart), the counts (requests, errors, ...) summed. A single
    round is returned as it is."""
    groups: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        groups[(r.workload, r.policy)].append(r)
    merged = []
    for runs in groups.values():
        if len(runs) == 1:
            merged.append(runs[0])
            continue
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(Result):
            values = [getattr(r, f.name) for r in runs]
            if f.name in _SUMMED:
                changes[f.name] = sum(values)
            elif isinstance(values[0], dict):
                keys = dict.fromkeys(k for v in values for k in v)
                changes[f.name] = {k: statistics.median(v[k] for v in values if k in v) for k in keys}
            elif isinstance(values[0], float) or f.name == "stickiness":
                present = [v for v in values if v is not None and math.isfinite(v)]
                changes[f.name] = statistics.median(present) if present else values[0]
        changes["round"] = -1  # a median, not a run
        changes["first_error"] = next((r.first_error for r in runs if r.first_error), "")
        merged.append(dataclasses.replace(runs[0], **changes))
    return merged


def format_cpu_table(results: Sequence[Result], pods: int) -> str:
    """CPU-seconds per 1,000 completed requests of each policy's routing processes, per workload: the
    median over rounds, each round's figure in brackets; the picker's idle rate beside it; then each
    policy over every workload and round, and the issue's target (picker ≤ half of sglang-router)."""
    by_pair: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        by_pair[(r.workload, r.policy)].append(r)
    head = (
        f"{'workload':<18} {'policy':<20} {'routing CPU-s / 1k req':>22}   {'per round':<24} "
        f"{'picker':>7} {'envoy':>6} {'router':>6}   {'picker idle':>11}"
    )
    lines = [head, "-" * len(head)]
    last_kind = ""
    for (kind, policy), runs in by_pair.items():
        totals = [sum(routing_cpu_per_1k(r).values()) for r in runs if r.completed]
        parts = [routing_cpu_per_1k(r) for r in runs if r.completed]

        def median_of(name: str, parts: list[dict[str, float]] = parts) -> str:
            values = [p[name] for p in parts if name in p]
            return f"{statistics.median(values):6.2f}" if values else f"{'-':>6}"

        router = next((k for k in PEER_KINDS if any(k in p for p in parts)), "")
        idle = [r.idle_cores["picker"] for r in runs if "picker" in r.idle_cores]
        label = f"{kind} {WORKLOADS[kind]}" if kind != last_kind else ""
        last_kind = kind
        lines.append(
            f"{label:<18} {_label(policy):<20} {statistics.median(totals) if totals else math.nan:22.2f}   "
            f"{'[' + ' '.join(f'{t:.2f}' for t in totals) + ']':<24} "
            f"{median_of('picker'):>7} {median_of('envoy'):>6} {median_of(router) if router else '-':>6}   "
            + (f"{statistics.median(idle):6.3f} cores" if idle else f"{'-':>11}")
        )
    lines.append("")
    lines.append("each policy over every workload and round (median of runs): routing CPU-s per 1k requests")
    overall: dict[str, float] = {}
    for policy in dict.fromkeys(r.policy for r in results):
        per_run = [routing_cpu_per_1k(r) for r in results if r.policy == policy and r.completed]
        if not per_run:
            continue
        overall[policy] = statistics.median(sum(p.values()) for p in per_run)
        names = dict.fromkeys(k for p in per_run for k in p)
        split = ", ".join(f"{n} {statistics.median(p[n] for p in per_run if n in p):.2f}" for n in names)
        idle = [r.idle_cores["picker"] for r in results if r.policy == policy and "picker" in r.idle_cores]
        lines.append(
            f"  {_label(policy):<20} {overall[policy]:6.2f}   ({split})"
            + (f"; picker idle {statistics.median(idle):.3f} cores at {pods} pods" if idle else "")
        )
        parts = [_picker_parts(r) for r in results if r.policy == policy and r.completed and _PICKER_MAIN in r.cpu_s]
        if parts:
            lines.append(
                f"  {'':<20}        the picker's request path {statistics.median(p[0] for p in parts):.2f}, "
                f"its scrape worker {statistics.median(p[1] for p in parts):.2f} (idle not subtracted)"
            )
    if "sglang-router" in overall:
        peer = overall["sglang-router"]
        for policy in (p for p in overall if _peer(p) is None and p not in _NOT_PICKERS):
            picker = _median_picker(results, policy)
            lines.append(
                f"  target (issue 14): picker above idle / sglang-router ≤ 0.5: {_label(policy)} "
                f"{picker:.2f} / {peer:.2f} = {picker / peer:.2f} "
                + ("(met)" if picker / peer <= 0.5 else f"(not met: {picker / peer / 0.5:.1f}x the target)")
            )
        if "floor" in overall:  # not a picker: what the reference exchange's messages cost on this transport
            floor = _median_picker(results, "floor")
            lines.append(
                f"  the protocol's floor (the same ext_proc messages, no work) / sglang-router: "
                f"{floor:.2f} / {peer:.2f} = {floor / peer:.2f}"
            )
    return "\n".join(lines)


def _median_picker(results: Sequence[Result], policy: str) -> float:
    """The median over ``policy``'s completed runs of its picker's CPU-s per 1,000 requests above idle."""
    return statistics.median(
        routing_cpu_per_1k(r).get("picker", math.nan) for r in results if r.policy == policy and r.completed
    )


def _picker_parts(r: Result) -> tuple[float, float]:
    """CPU-seconds per 1,000 requests of the picker's request-path process and of its scrape worker,
    over the load (neither with the idle rate subtracted: it is measured for the two together)."""
    main = r.cpu_s[_PICKER_MAIN]
    return main / r.completed * 1000, (r.cpu_s["picker"] - main) / r.completed * 1000


def format_table(results: Sequence[Result]) -> str:
    """The results as a fixed-width text table, with an oracle row per workload."""
    head = (
        f"{'workload':<18} {'policy':<20} {'hit rate':>8} {'/oracle':>7} {'TTFT P50':>9} {'P90':>8} "
        f"{'P90/rr':>6} {'req/s':>6} {'tok/s':>6} {'sticky':>6} {'imbal':>5} {'ok/sent':>9} {'CPU':>5}"
    )
    lines = [head, "-" * len(head)]
    by_workload: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_workload[r.workload].append(r)
    for kind, rows in by_workload.items():
        rr = next((r for r in rows if r.policy == "rr"), None)
        label = f"{kind} {WORKLOADS[kind]}"
        for r in rows:
            rel = f"{r.ttft_p90_ms / rr.ttft_p90_ms:6.2f}" if rr and rr.ttft_p90_ms > 0 else f"{'-':>6}"
            oracle = f"{r.hit_rate / r.oracle_hit_rate:7.0%}" if r.oracle_hit_rate > 0 else f"{'-':>7}"
            sticky = f"{r.stickiness:6.0%}" if r.stickiness is not None else f"{'-':>6}"
            lines.append(
                f"{label:<18} {_label(r.policy):<20} {r.hit_rate:8.1%} {oracle} {r.ttft_p50_ms:7.0f}ms "
                f"{r.ttft_p90_ms:6.0f}ms {rel} {r.req_per_s:6.1f} {r.tokens_per_s:6.0f} {sticky} {r.imbalance:5.2f} "
                f"{f'{r.completed}/{r.requests}':>9} {sum(v for k, v in r.cpu_cores.items() if k != _PICKER_MAIN):5.2f}"
            )
            label = ""
        lines.append(f"{'':<18} {'oracle (bound)':<20} {rows[0].oracle_hit_rate:8.1%}")
    notes = [
        f"{r.workload}/{r.policy}: {r.errors} errors, {r.unfinished} unfinished, {r.preemptions} preemptions, "
        f"{r.wrong_answers} unexpected answers" + (f"; first error {r.first_error}" if r.first_error else "")
        for r in results
        if r.errors or r.unfinished or r.preemptions or r.wrong_answers
    ]
    return "\n".join(lines + notes)


def write_chart(results: Sequence[Result], path: Path) -> bool:
    """A PNG with hit rate (and the oracle), TTFT P50/P90 and throughput per workload and policy; False
    (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    kinds = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    get = {(r.workload, r.policy): r for r in results}
    x = np.arange(len(kinds))
    width = 0.8 / (len(policies) + 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 5))
    for i, policy in enumerate(policies):
        offset = (i - len(policies) / 2) * width
        rows = [get.get((k, policy)) for k in kinds]
        bars = axes[0].bar(
            x + offset, [r.hit_rate * 100 if r else 0 for r in rows], width, label=_label(policy), color=f"C{i}"
        )
        axes[0].bar_label(bars, fmt="%.0f", fontsize="small")
        axes[1].bar(x + offset, [_finite(r.ttft_p90_ms) if r else 0 for r in rows], width, color=f"C{i}")
        axes[1].scatter(
            x + offset, [_finite(r.ttft_p50_ms) if r else 0 for r in rows], color="black", marker="_", s=200, zorder=3
        )
        axes[2].bar(x + offset, [r.tokens_per_s if r else 0 for r in rows], width, color=f"C{i}")
    oracle = [next(r.oracle_hit_rate for r in results if r.workload == k) * 100 for k in kinds]
    bars = axes[0].bar(
        x + (len(policies) / 2) * width, oracle, width, label="oracle (bound)", color="lightgray", edgecolor="gray"
    )
    axes[0].bar_label(bars, fmt="%.0f", fontsize="small")
    axes[0].set_ylim(0, 105)
    labels = [f"{k}: {WORKLOADS[k]}" for k in kinds]
    for ax, title, unit in (
        (axes[0], "prefix-cache hit rate", "%"),
        (axes[1], "TTFT: bar P90, tick P50", "ms (log)"),
        (axes[2], "output throughput", "tokens/s"),
    ):
        ax.set_xticks(x, labels)
        ax.set_title(title)
        ax.set_ylabel(unit)
    if any(_finite(r.ttft_p90_ms) > 0 for r in results):
        axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(ScalarFormatter())
    axes[1].yaxis.set_minor_formatter(ScalarFormatter())
    axes[1].tick_params(axis="y", which="minor", labelsize="x-small")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(policies) + 1, frameon=False)
    fig.suptitle("Routing quality on a simulated vLLM pool")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0


def _json_safe(value: Any) -> Any:
    """NaN (a percentile of nothing) as null: strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def idle_at(pods: int, window: float) -> dict[str, float]:
    """The picker's idle rate with ``pods`` stand-in pods, from ``bench/scrape_cost.py``'s farm (full-size
    vLLM pages, one loopback address per pod, idle: the same page every scrape): ``cores_on`` the picker
    and its scrape worker with its defaults (idle pods backed off to once a second), ``cores_off`` the
    same picker with scraping off, ``scrapes_per_s_on`` achieved."""
    spec = importlib.util.spec_from_file_location("scrape_cost", _ROOT / "bench" / "scrape_cost.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _, runs = module.measure_cost(
        pods, window, 1, idle=True, settle=5.0, modes=["backoff", "scraping off"], baseline=None
    )
    on, off = runs["backoff"][0], runs["scraping off"][0]
    return {"pods": pods, "cores_on": on["cores"], "cores_off": off["cores"], "scrapes_per_s_on": on["scrapes_per_s"]}


def _format_idle(cost: dict[str, float]) -> str:
    return (
        f"picker idle rate at {cost['pods']:.0f} idle pods (scrape_cost.py's farm): {cost['cores_on']:.3f} cores "
        f"({cost['cores_off']:.3f} with scraping off; {cost['scrapes_per_s_on']:.0f} scrapes/s, the idle "
        f"backoff asking each pod about once a second)"
    )


# --cpu-comparison: issue 14's side-by-side CPU figure, sized to fit ~30 minutes on a shared 2-core machine.
_CPU_COMPARISON = {
    "policies": "rr,default,floor,sglang-router,vllm-router",
    "rounds": 3,
    "max_tokens": 16,
    "duration": 20.0,
    "drain": 30.0,
}


def _parser(preset: bool = False) -> argparse.ArgumentParser:
    d = (
        dataclasses.replace(
            Options(),
            **{k: v for k, v in _CPU_COMPARISON.items() if k != "policies"},
            policies=tuple(str(_CPU_COMPARISON["policies"]).split(",")),
        )
        if preset
        else Options()
    )
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="about a minute: 3 s of arrivals per run, 15 s drain")
    p.add_argument(
        "--cpu-comparison",
        action="store_true",
        help="issue 14's side-by-side CPU run; its defaults: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in _CPU_COMPARISON.items())
        + " (explicit flags win); ~21 min on a 2-core machine",
    )
    p.add_argument("--pods", type=int, default=d.pods)
    p.add_argument("--workloads", default=",".join(d.workloads), help="comma-separated, of " + ",".join(WORKLOADS))
    p.add_argument(
        "--policies",
        default=",".join(d.policies),
        help=f"comma-separated, of {','.join(POLICIES)}; config:PATH (the picker with that config); "
        "a picker policy +FLAG=VALUE the picker with --FLAG=VALUE (default+io-thread=false), +observe "
        "behind an Envoy that observes responses (default+observe), @PYTHON under that "
        "interpreter (default@/tmp/old-python); "
        f"sglang-router and vllm-router are their {_PEER_POLICY}, KIND:POLICY another of theirs",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help="run every workload x policy this many times (policies alternating); tables show medians",
    )
    p.add_argument("--duration", type=float, default=d.duration, help="wall seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=d.drain, help="wall seconds after that before cutting off")
    p.add_argument("--load", type=float, default=d.load, help="offered load, fraction of the no-hit capacity")
    p.add_argument("--users", type=int, default=d.users, help="closed loop with N users (0: open loop, Poisson)")
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="wall seconds per simulated second")
    p.add_argument("--groups", type=int, default=d.groups, help="system prompts of workload a")
    p.add_argument("--popularity", choices=("uniform", "zipf"), default=d.popularity, help="group popularity (a)")
    p.add_argument("--zipf-s", type=float, default=d.zipf_s, help="exponent of the zipf popularity")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=d.max_tokens,
        help="output tokens per request, each one streamed event (keep it short to compare routing CPU)",
    )
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=d.cache_fraction,
        help="KV cache per pod, as a fraction of workload a's prefix working set",
    )
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="KV blocks per pod (overrides)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--idle-window",
        type=float,
        default=d.idle_window,
        help="seconds of the picker's idle CPU (no traffic, same pool) before each load",
    )
    p.add_argument(
        "--idle-pods",
        default="",
        help="also measure the picker's idle rate at these pool sizes (comma-separated, e.g. 100) "
        "on bench/scrape_cost.py's stand-in pods",
    )
    p.add_argument("--skip-routing", action="store_true", help="only the --idle-pods measurement")
    p.add_argument("--json", type=Path, default=_ROOT / "bench" / "results" / "routing_quality.json")
    p.add_argument("--png", type=Path, default=_ROOT / "bench" / "results" / "routing_quality.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    preset = "--cpu-comparison" in (sys.argv[1:] if argv is None else argv)
    args = _parser(preset).parse_args(argv)
    duration, drain = (3.0, 15.0) if args.quick else (args.duration, args.drain)
    try:
        opts = Options(
            pods=args.pods,
            workloads=tuple(w for w in args.workloads.split(",") if w),
            policies=tuple(p for p in args.policies.split(",") if p),
            duration=duration,
            drain=drain,
            load=args.load,
            users=args.users,
            time_scale=args.time_scale,
            groups=args.groups,
            popularity=args.popularity,
            zipf_s=args.zipf_s,
            max_tokens=args.max_tokens,
            cache_fraction=args.cache_fraction,
            num_gpu_blocks=args.num_gpu_blocks,
            seed=args.seed,
            rounds=args.rounds,
            idle_window=args.idle_window,
        )
        idle_pods = [int(n) for n in args.idle_pods.split(",") if n.strip()]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.skip_routing and not (opts.workloads and opts.policies):
        print("error: give at least one workload and one policy (or --skip-routing with --idle-pods)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    idle: list[dict[str, float]] = []
    try:
        for pods in idle_pods:
            idle.append(idle_at(pods, opts.idle_window * 2))
            print(_format_idle(idle[-1]), flush=True)
        results = [] if args.skip_routing else run(opts)
    except (ValueError, RuntimeError, TimeoutError, OSError) as exc:  # EnvoyError, PeerError are RuntimeErrors
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if results:
        medians = median_results(results)
        rounds = f", median of {opts.rounds} rounds" if opts.rounds > 1 else ""
        print(f"\nRouting quality ({opts.pods} pods, {opts.max_tokens} output tokens per request{rounds})")
        print(format_table(medians))
        print(
            f"\nRouting CPU: CPU-seconds per 1,000 completed requests (user + system, /proc) of the processes that"
            f" route: picker above its idle rate (measured {opts.idle_window:g} s before each load, same pool,"
            f" subtracted x the load's wall time) and Envoy apart; a peer router whole (it is the proxy);"
            f" rr is Envoy alone. Not counted: the simulated pods and the client."
        )
        print(format_cpu_table(results, opts.pods))
        print(
            f"\n{time.perf_counter() - started:.0f} s in all; latencies are wall clock at time scale {opts.time_scale}"
        )
    for cost in idle if results else ():  # printed again below a long run's tables
        print(_format_idle(cost))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "options": asdict(opts),
        "results": [asdict(r) for r in results],
        "medians": [asdict(r) for r in median_results(results)],
        "idle_at": idle,
        "peers": {k: peer_version(k) for k in PEER_KINDS},
    }
    args.json.write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False))
    print(f"results: {args.json}")
    if not results:
        return 0
    if write_chart(median_results(results), args.png):
        print(f"chart: {args.png}")
    else:
        print("chart: skipped (pip install matplotlib, or -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
