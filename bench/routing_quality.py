"""Routing quality: prefix-cache hit rate, TTFT and throughput of each routing policy, on one trace.

Everything runs on 127.0.0.1: a real Envoy, the picker (``epp serve``, a child process) and the vLLM
simulator (``python -m epp.sim``, a child process, 8 pods by default). The client is this process
(asyncio + aiohttp), streaming OpenAI chat completions through Envoy.

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
``config:PATH`` the picker with any other config file, to try a variant on the same trace.

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

Measured per policy: hit rate = Δ``vllm:prefix_cache_hits_total`` / Δ``vllm:prefix_cache_queries_total``
summed over the pods (the simulator's counters, in tokens); TTFT P50/P90, client-side, from sending
the request to the first SSE chunk that carries a generated token (a chunk without one, such as
the chat role chunk, is skipped); throughput = completed requests/s and
output tokens/s from the first send to the last completion; the CPU (user+system, from /proc) each
process used during the load, in cores. Diagnostics: stickiness (share of requests of a group or
session that went to the same pod as the previous one of that family), pod imbalance (busiest pod's
requests / mean), preemptions, how late the client sent (P99 lag: a late client means a busy CPU).

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

Run: ``python bench/routing_quality.py`` (about 6 minutes: 3 workloads x 3 policies x 30 s of
arrivals plus start-up and drain; ~0.15 cores for round robin, ~0.5-0.7 with the picker, all four
processes together, on the 2-core development machine), ``--quick`` for about a minute (3 s of
arrivals per run: too few requests per group for stable figures; for development). Prints the
table and each run's CPU, writes ``--json`` and a PNG chart (``--png``; needs matplotlib:
``pip install -e '.[bench]'``). Everything it starts is stopped when it ends or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
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
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, cpu_seconds, wait_for_picker

__all__ = [
    "POLICIES",
    "WORKLOADS",
    "Options",
    "Result",
    "Workload",
    "format_table",
    "main",
    "make_workload",
    "oracle_hit_rate",
    "run",
    "write_chart",
]

_ROOT = Path(__file__).resolve().parent.parent
_QUEUE_KV_CONFIG = _ROOT / "deploy" / "config" / "queue-kv-only.yaml"
_COST = EngineConfig()  # the simulator's default cost model, which the child process also uses
MODEL = _COST.model

WORKLOADS = {"a": "shared prefix", "b": "multi-turn chat", "c": "no sharing"}
POLICIES = {"rr": "round robin", "queue-kv": "queue + KV", "default": "prefix + queue + KV"}

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
    plan = plan_output(prompt, model=MODEL, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                       mean_output_tokens=_COST.mean_output_tokens)
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
    items = [Item(i.family, i.turns, i.think_s, float(at)) for i, at in zip(items, arrivals)]
    working_set = sum(len(p) // BYTES_PER_TOKEN for p in group_prompts)
    return Workload(kind, tuple(items), rate, capacity, working_set)


def oracle_hit_rate(workload: Workload, *, seed: int, block_size: int = BLOCK_SIZE) -> float:
    """The hit rate with one unlimited cache shared by every request, in trace order (module docstring)."""
    seen: set[int] = set()
    hits = queries = 0
    chain_seed = model_seed(MODEL)
    for item in workload.items:
        for turn in item.turns:
            prompt = render_chat(turn.messages)
            plan = plan_output(prompt, model=MODEL, seed=seed, max_tokens=len(turn.answer) // BYTES_PER_TOKEN,
                               ignore_eos=True, mean_output_tokens=_COST.mean_output_tokens)
            hashes = block_hashes(np.concatenate((prompt, plan.token_ids)), chain_seed, block_size).tolist()
            n = 0
            for h in hashes[: (len(prompt) - 1) // block_size]:
                if h not in seen:
                    break
                n += 1
            hits += n * block_size
            queries += len(prompt)
            seen.update(hashes[: (len(prompt) + len(plan.token_ids) - 1) // block_size])
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


_decode = msgspec.json.Decoder()


async def _send(session: aiohttp.ClientSession, url: str, turn: Turn, record: Record, max_tokens: int) -> bool:
    body = {"model": MODEL, "messages": [{"role": r, "content": c} for r, c in turn.messages],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    try:
        async with session.post(url, data=msgspec.json.encode(body),
                                headers={"content-type": "application/json"}) as resp:
            record.status = resp.status
            record.pod = resp.headers.get("x-sim-pod", "")
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
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return False
    record.done = time.perf_counter()
    record.answer_ok = "".join(parts) == turn.answer
    return record.ttft is not None


async def _run_item(session: aiohttp.ClientSession, url: str, item: Item, records: list[Record],
                    opts: Options, scheduled: float) -> None:
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
    cpu_cores: dict[str, float] = field(default_factory=dict)
    stickiness: float | None = None
    imbalance: float = 0.0
    preemptions: int = 0
    lag_p99_ms: float = 0.0
    wrong_answers: int = 0
    wall_s: float = 0.0
    first_error: str = ""


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


_COUNTER = re.compile(rb"^(vllm:prefix_cache_queries_total|vllm:prefix_cache_hits_total|vllm:num_preemptions_total)"
                      rb"(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


async def _sim_counters(pods: Sequence[str]) -> Counter[str]:
    totals: Counter[str] = Counter()
    query = "&".join(f"name[]={n}" for n in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                                              "vllm:num_preemptions_total"))
    async with aiohttp.ClientSession() as session:
        for pod in pods:
            async with session.get(f"http://{pod}/metrics?{query}") as resp:
                page = await resp.read()
            for name, value in _COUNTER.findall(page):
                totals[name.decode()] += float(value)
    return totals


class _Simulator:
    """``python -m epp.sim`` as a child process."""

    def __init__(self, opts: Options, num_gpu_blocks: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "epp.sim", "--pods", str(opts.pods), "--seed", str(opts.seed),
             "--time-scale", str(opts.time_scale), "--num-gpu-blocks", str(num_gpu_blocks),
             "--max-model-len", str(num_gpu_blocks * BLOCK_SIZE)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )
        assert self.process.stdout is not None
        self.pods = []
        for _ in range(opts.pods):
            line = self.process.stdout.readline()
            if not line:
                self.stop()
                raise RuntimeError(f"the simulator exited with status {self.process.wait()}")
            self.pods.append(line.split()[1].removeprefix("http://"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def num_gpu_blocks(opts: Options) -> int:
    """KV blocks per simulated pod: ``opts.num_gpu_blocks``, or ``cache_fraction`` of workload a's prefixes."""
    if opts.num_gpu_blocks:
        return opts.num_gpu_blocks
    group_prompts = _group_prompts(np.random.default_rng([opts.seed, 0]), opts.groups)
    working_set_blocks = sum(len(p) // BYTES_PER_TOKEN for p in group_prompts) // BLOCK_SIZE
    # At least room for the longest chat session of workload b and some concurrency.
    return max(1024, round(opts.cache_fraction * working_set_blocks))


def run_policy(workload: Workload, policy: str, opts: Options, oracle: float, blocks: int) -> Result:
    """Start a cold simulator, the policy's gateway, send the workload, and measure."""
    _check_policy(policy)
    sim = _Simulator(opts, blocks)
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        if policy == "rr":
            bootstrap = render_round_robin(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                                            pool_endpoints=tuple(sim.pods)))
        else:
            config = _QUEUE_KV_CONFIG if policy == "queue-kv" else policy.removeprefix("config:")
            extra = ["--config-file", str(config)] if policy != "default" else []
            picker = PickerProcess(sim.pods, extra_args=extra)
            picker.start()
            bootstrap = render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                                picker_port=picker.grpc_port))
        envoy = EnvoyProcess(bootstrap, concurrency=1)
        envoy.start()
        if picker is not None:
            wait_for_picker(envoy)
            time.sleep(_SETTLE_S)
        url = f"http://127.0.0.1:{envoy.listen_port}"
        pids = {"simulator": sim.process.pid, "envoy": envoy.pid}
        if picker is not None:
            pids["picker"] = picker.pid
        before = asyncio.run(_sim_counters(sim.pods))
        cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client0 = time.process_time()
        wall0 = time.perf_counter()
        records, unfinished = _run_loop(_drive(url, workload, opts))
        wall = time.perf_counter() - wall0
        cpu = {name: (cpu_seconds(pid) - cpu0[name]) / wall for name, pid in pids.items()}
        cpu["client"] = (time.process_time() - client0) / wall
        after = asyncio.run(_sim_counters(sim.pods))
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
            with contextlib.suppress(OSError):
                os.unlink(picker.log_path)
        sim.stop()
    return _summarise(workload, policy, records, unfinished, before, after, cpu, oracle, wall)


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _summarise(workload: Workload, policy: str, records: list[Record], unfinished: int, before: Counter[str],
               after: Counter[str], cpu: dict[str, float], oracle: float, wall: float) -> Result:
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
    )


# -- the whole run -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    pods: int = 8
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    policies: tuple[str, ...] = tuple(POLICIES)
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

    def __post_init__(self) -> None:
        for name in ("pods", "groups", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("duration", "time_scale", "load", "cache_fraction", "zipf_s"):
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
    if policy.startswith("config:"):
        if not Path(policy.removeprefix("config:")).is_file():
            raise ValueError(f"policy {policy!r}: no such file")
    elif policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)} or config:PATH")


def _label(policy: str) -> str:
    return POLICIES.get(policy) or Path(policy.removeprefix("config:")).stem


def run(opts: Options, *, log: Any = print) -> list[Result]:
    """Every policy on every workload; one :class:`Result` per pair, in order."""
    blocks = num_gpu_blocks(opts)
    log(f"pool: {opts.pods} simulated pods, {blocks} KV blocks ({blocks * BLOCK_SIZE} tokens) each, "
        f"time scale {opts.time_scale}; load: " + (f"closed loop, {opts.users} users" if opts.users else
                                                   f"open loop, Poisson, {opts.load:.0%} of no-hit capacity"))
    results = []
    for kind in opts.workloads:
        workload = make_workload(kind, opts)
        longest = max(t.prompt_tokens for item in workload.items for t in item.turns) + opts.max_tokens
        if longest > blocks * BLOCK_SIZE:
            raise ValueError(f"workload {kind} has a request of {longest} tokens: more than a pod's KV cache "
                             f"({blocks} blocks of {BLOCK_SIZE}); give more --num-gpu-blocks")
        oracle = oracle_hit_rate(workload, seed=opts.seed)
        log(f"workload {kind} ({WORKLOADS[kind]}): {len(workload.items)} items, {workload.requests} requests, "
            f"{workload.rate_per_s / opts.time_scale:.1f} req/s wall offered "
            f"(no-hit capacity {workload.capacity_per_s / opts.time_scale:.1f}), oracle hit rate {oracle:.1%}")
        for policy in opts.policies:
            result = run_policy(workload, policy, opts, oracle, blocks)
            log(f"  {policy:<9} done in {result.wall_s:.0f}s: hit {result.hit_rate:.1%}, TTFT P90 "
                f"{result.ttft_p90_ms:.0f} ms, CPU " + ", ".join(f"{k} {v:.2f}" for k, v in result.cpu_cores.items())
                + f" = {sum(result.cpu_cores.values()):.2f} cores")
            results.append(result)
    return results


def format_table(results: Sequence[Result]) -> str:
    """The results as a fixed-width text table, with an oracle row per workload."""
    head = (f"{'workload':<18} {'policy':<20} {'hit rate':>8} {'/oracle':>7} {'TTFT P50':>9} {'P90':>8} "
            f"{'P90/rr':>6} {'req/s':>6} {'tok/s':>6} {'sticky':>6} {'imbal':>5} {'ok/sent':>9} {'CPU':>5}")
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
                f"{f'{r.completed}/{r.requests}':>9} {sum(r.cpu_cores.values()):5.2f}"
            )
            label = ""
        lines.append(f"{'':<18} {'oracle (bound)':<20} {rows[0].oracle_hit_rate:8.1%}")
    notes = [f"{r.workload}/{r.policy}: {r.errors} errors, {r.unfinished} unfinished, {r.preemptions} preemptions, "
             f"{r.wrong_answers} unexpected answers" + (f"; first error {r.first_error}" if r.first_error else "")
             for r in results if r.errors or r.unfinished or r.preemptions or r.wrong_answers]
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
        bars = axes[0].bar(x + offset, [r.hit_rate * 100 if r else 0 for r in rows], width, label=_label(policy),
                           color=f"C{i}")
        axes[0].bar_label(bars, fmt="%.0f", fontsize="small")
        axes[1].bar(x + offset, [_finite(r.ttft_p90_ms) if r else 0 for r in rows], width, color=f"C{i}")
        axes[1].scatter(x + offset, [_finite(r.ttft_p50_ms) if r else 0 for r in rows], color="black", marker="_",
                        s=200, zorder=3)
        axes[2].bar(x + offset, [r.tokens_per_s if r else 0 for r in rows], width, color=f"C{i}")
    oracle = [next(r.oracle_hit_rate for r in results if r.workload == k) * 100 for k in kinds]
    bars = axes[0].bar(x + (len(policies) / 2) * width, oracle, width, label="oracle (bound)", color="lightgray",
                       edgecolor="gray")
    axes[0].bar_label(bars, fmt="%.0f", fontsize="small")
    axes[0].set_ylim(0, 105)
    labels = [f"{k}: {WORKLOADS[k]}" for k in kinds]
    for ax, title, unit in ((axes[0], "prefix-cache hit rate", "%"), (axes[1], "TTFT: bar P90, tick P50", "ms (log)"),
                            (axes[2], "output throughput", "tokens/s")):
        ax.set_xticks(x, labels)
        ax.set_title(title)
        ax.set_ylabel(unit)
    if any(_finite(r.ttft_p90_ms) > 0 for r in results):
        axes[1].set_yscale("log")
    axes[1].yaxis.set_major_formatter(ScalarFormatter())
    axes[1].yaxis.set_minor_formatter(ScalarFormatter())
    axes[1].tick_params(axis="y", which="minor", labelsize="x-small")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(policies) + 1, frameon=False)
    fig.suptitle("Routing quality: Envoy + epp + simulated vLLM pool")
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


def _parser() -> argparse.ArgumentParser:
    d = Options()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="about a minute: 3 s of arrivals per run, 15 s drain")
    p.add_argument("--pods", type=int, default=d.pods)
    p.add_argument("--workloads", default=",".join(d.workloads), help="comma-separated, of " + ",".join(WORKLOADS))
    p.add_argument("--policies", default=",".join(d.policies),
                   help=f"comma-separated, of {','.join(POLICIES)}, or config:PATH (the picker with that config)")
    p.add_argument("--duration", type=float, default=d.duration, help="wall seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=d.drain, help="wall seconds after that before cutting off")
    p.add_argument("--load", type=float, default=d.load, help="offered load, fraction of the no-hit capacity")
    p.add_argument("--users", type=int, default=d.users, help="closed loop with N users (0: open loop, Poisson)")
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="wall seconds per simulated second")
    p.add_argument("--groups", type=int, default=d.groups, help="system prompts of workload a")
    p.add_argument("--popularity", choices=("uniform", "zipf"), default=d.popularity, help="group popularity (a)")
    p.add_argument("--zipf-s", type=float, default=d.zipf_s, help="exponent of the zipf popularity")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request")
    p.add_argument("--cache-fraction", type=float, default=d.cache_fraction,
                   help="KV cache per pod, as a fraction of workload a's prefix working set")
    p.add_argument("--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="KV blocks per pod (overrides)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", type=Path, default=_ROOT / "bench" / "results" / "routing_quality.json")
    p.add_argument("--png", type=Path, default=_ROOT / "bench" / "results" / "routing_quality.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    duration, drain = (3.0, 15.0) if args.quick else (args.duration, args.drain)
    try:
        opts = Options(
            pods=args.pods, workloads=tuple(w for w in args.workloads.split(",") if w),
            policies=tuple(p for p in args.policies.split(",") if p), duration=duration, drain=drain,
            load=args.load, users=args.users, time_scale=args.time_scale, groups=args.groups,
            popularity=args.popularity, zipf_s=args.zipf_s, max_tokens=args.max_tokens,
            cache_fraction=args.cache_fraction, num_gpu_blocks=args.num_gpu_blocks, seed=args.seed,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        results = run(opts)
    except (ValueError, RuntimeError, TimeoutError, OSError) as exc:  # EnvoyError is a RuntimeError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print()
    print(format_table(results))
    print(f"\n{time.perf_counter() - started:.0f} s in all; latencies are wall clock at time scale {opts.time_scale}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    report = {"options": asdict(opts), "results": [asdict(r) for r in results]}
    args.json.write_text(json.dumps(_json_safe(report), indent=1, allow_nan=False))
    print(f"results: {args.json}")
    if write_chart(results, args.png):
        print(f"chart: {args.png}")
    else:
        print("chart: skipped (pip install matplotlib, or -e '.[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
