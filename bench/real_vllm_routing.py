"""Routing quality against real vLLM 0.32: prefix-cache hit rate and TTFT, picker vs round robin.

Three real vLLM servers (CPU, the real-vLLM tier's tiny model: ``EPP_VLLM_PYTHON`` /
``EPP_VLLM_MODELS`` from ``tests/realvllm/setup_tier.sh``) behind a real Envoy, either alone with
round robin (``rr``) or with the picker and its default profile (``default``). Workloads, made from
``--seed`` and sized for the tiny model's 4,096-token context:

* **a, shared prefix**: ``--groups`` system prompts of ~1,000 tokens; each request is one group's
  prompt (uniformly chosen) plus a fresh short question;
* **b, multi-turn chat**: sessions of 3 turns (chat completions through the model's chat template),
  each with its own ~600-token system prompt; every turn sends the whole conversation so far,
  including the answers the server gave;
* **c, no sharing**: a unique prompt of the same length per request.

Each (workload, policy) run starts from empty caches (``POST /reset_prefix_cache``, served with
``VLLM_SERVER_DEV_MODE=1``) and a fresh picker, then ``--users`` clients send ``--requests``
streamed completions in a closed loop. Hit rate is the servers' own counters
(``vllm:prefix_cache_hits_total`` / ``_queries_total``, tokens, summed over the servers); TTFT is
client-side, from sending to the first chunk carrying text. Wall-clock latencies on a shared 2-core
machine: read the ratios. Run: ``python bench/real_vllm_routing.py [--requests 48] [--users 4]``.
Talks only to 127.0.0.1; bounded; every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from epp.envoy.bootstrap import BootstrapOptions, render, render_round_robin
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, wait_for_picker
from epp.testing.vllm import BASE, VllmServer, http_post, start_vllm, tier_paths

_WORDS = [f"w{i}" for i in range(400)]  # short words the tiny tokenizer splits into a few tokens


@dataclass
class Result:
    workload: str
    policy: str
    requests: int
    errors: int  # not 200
    no_text: int  # 200, but no chunk carried text (no TTFT to count)
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def make_prompts(kind: str, requests: int, groups: int, seed: int) -> list[str]:
    rng = random.Random(f"{seed}-{kind}")
    if kind == "a":
        systems = [_text(rng, 300) for _ in range(groups)]
        return [f"{rng.choice(systems)}\nQ: {_text(rng, 8)}" for _ in range(requests)]
    return [_text(rng, 300) for _ in range(requests)]


async def _one(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, float | None]:
    """The status and the TTFT (None: no chunk carried text, e.g. a random model's empty tokens)."""
    body = {"model": BASE, "prompt": prompt, "max_tokens": 8, "stream": True}
    sent = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return response.status, None
        ttft = None
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    ttft = time.perf_counter() - sent
        return 200, ttft


async def _chat_turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]
                     ) -> tuple[int, float | None, str]:
    body = {"model": BASE, "messages": messages, "max_tokens": 8, "stream": True}
    sent = time.perf_counter()
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            await response.read()
            return response.status, None, ""
        ttft, parts = None, []
        async for line in response.content:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content") or ""
                if text and ttft is None:
                    ttft = time.perf_counter() - sent
                parts.append(text)
        return 200, ttft, "".join(parts)


async def _drive_chat(url: str, sessions: list[list[str]], users: int) -> list[tuple[int, float | None]]:
    queue = list(sessions)
    out: list[tuple[int, float | None]] = []

    async def user(session: aiohttp.ClientSession) -> None:
        while queue:
            system, *questions = queue.pop(0)
            messages = [{"role": "system", "content": system}]
            for question in questions:
                messages.append({"role": "user", "content": question})
                status, ttft, answer = await _chat_turn(session, url, messages)
                out.append((status, ttft))
                messages.append({"role": "assistant", "content": answer})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(user(session) for _ in range(users)))
    return out


def make_sessions(requests: int, seed: int, turns: int = 3) -> list[list[str]]:
    rng = random.Random(f"{seed}-b")
    return [[_text(rng, 150), *(_text(rng, 8) for _ in range(turns))] for _ in range(max(1, requests // turns))]


async def _drive(url: str, prompts: list[str], users: int) -> list[tuple[int, float | None]]:
    queue = list(enumerate(prompts))
    out: list[tuple[int, float | None]] = [(0, None)] * len(prompts)

    async def user(session: aiohttp.ClientSession) -> None:
        while queue:
            i, prompt = queue.pop(0)
            out[i] = await _one(session, url, prompt)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(user(session) for _ in range(users)))
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000


def run_one(servers: list[VllmServer], kind: str, policy: str, prompts: list[Any], users: int) -> Result:
    for server in servers:
        status, body = http_post(f"{server.url}/reset_prefix_cache", b"")
        if status != 200:
            raise RuntimeError(f"reset_prefix_cache on {server.name}: {status} {body[:200]!r}")
    picker: PickerProcess | None = None
    envoy: EnvoyProcess | None = None
    try:
        options = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                   pool_endpoints=tuple(s.hostport for s in servers))
        if policy == "rr":
            bootstrap = render_round_robin(options)
        else:
            picker = PickerProcess([s.hostport for s in servers])
            picker.start()
            bootstrap = render(BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0,
                                                picker_port=picker.grpc_port))
        envoy = EnvoyProcess(bootstrap, concurrency=1)
        envoy.start()
        if picker is not None:
            wait_for_picker(envoy, timeout=60)
            time.sleep(0.5)
        before = [(s.counter("vllm:prefix_cache_hits_total"), s.counter("vllm:prefix_cache_queries_total"))
                  for s in servers]
        url = f"http://127.0.0.1:{envoy.listen_port}"
        answers = asyncio.run(_drive_chat(url, prompts, users) if kind == "b" else _drive(url, prompts, users))
        after = [(s.counter("vllm:prefix_cache_hits_total"), s.counter("vllm:prefix_cache_queries_total"))
                 for s in servers]
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    done = [t for status, t in answers if t is not None]
    errors = sum(1 for status, _ in answers if status != 200)
    if errors:
        print(f"  statuses: {sorted({status for status, _ in answers})}", flush=True)
    return Result(kind, policy, len(answers), errors, len(answers) - errors - len(done),
                  hits / queries if queries else 0.0, _pct(done, 50), _pct(done, 90))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--workloads", default="a,b,c")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each (workload, policy), alternating")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    paths = tier_paths()
    if paths is None:
        print("needs EPP_VLLM_PYTHON and EPP_VLLM_MODELS (source tests/realvllm/setup_tier.sh)", file=sys.stderr)
        return 2
    python, models = paths
    servers = [start_vllm(python, models, f"s{i}", kv_events=False, max_model_len=4096,
                          extra_env={"VLLM_SERVER_DEV_MODE": "1"}) for i in range(args.servers)]
    results: list[Result] = []
    try:
        for server in servers:
            server.wait_healthy()
        for kind in args.workloads.split(","):
            prompts: list[Any] = (make_sessions(args.requests, args.seed) if kind == "b"
                                  else make_prompts(kind, args.requests, args.groups, args.seed))
            for _ in range(args.rounds):
                for policy in ("rr", "default"):
                    results.append(run_one(servers, kind, policy, prompts, args.users))
                    r = results[-1]
                    print(f"  {r.workload} {r.policy:<8} hit {r.hit_rate:6.1%}  TTFT P50 {r.ttft_p50_ms:7.1f} ms"
                          f"  P90 {r.ttft_p90_ms:7.1f} ms  errors {r.errors}/{r.requests}"
                          f"  (no text: {r.no_text})", flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"\n{args.servers} real vLLM 0.32 servers, {args.requests} streamed requests per run, {args.users} users "
          f"(medians over {args.rounds} round(s))")
    print(f"{'workload':<18} {'policy':<12} {'hit rate':>9} {'TTFT P50':>10} {'TTFT P90':>10} {'errors':>7}")
    names = {"a": "a shared prefix", "b": "b multi-turn", "c": "c no sharing"}
    for kind in args.workloads.split(","):
        for policy in ("rr", "default"):
            rs = [r for r in results if r.workload == kind and r.policy == policy]
            print(f"{names.get(kind, kind):<18} {'round robin' if policy == 'rr' else 'epp default':<12} "
                  f"{statistics.median(r.hit_rate for r in rs):>9.1%} "
                  f"{statistics.median(r.ttft_p50_ms for r in rs):>8.1f}ms "
                  f"{statistics.median(r.ttft_p90_ms for r in rs):>8.1f}ms {sum(r.errors for r in rs):>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
