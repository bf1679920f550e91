"""How fast the prefix-cache index hashes and matches, what add() costs, and how much memory it holds.

    python bench/prefix_index.py [--endpoints 64] [--capacity 31250] [--runs 2000]

Builds a full index (every endpoint at its capacity, no block shared between endpoints: the
worst case for memory), then times, with a fixed seed:
  * hash only, and hash + match, for an 8k-token (32 KB) and a 100k-token (400 KB) prompt that
    match nothing (cold), match one endpoint whole (repeat), or share a prefix with several
    endpoints held to different depths (partial: the two-lookup path);
  * add() of an 8k-token prompt: all blocks already held (refresh), a shared prefix plus new
    blocks (evicting as many), and all new (evicting 512 blocks);
  * memory: the index's numpy arrays (nbytes) and what tracemalloc saw allocated for the build.
For scale it also times the per-block Python loop of xxh3 calls that this replaces.
Numbers are microseconds, P50 and P99 over --runs calls. The machine is shared: compare medians
of a few runs, not one.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

import numpy as np
import xxhash

from epp.prefix_index import PrefixIndex, prompt_hashes

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKENS_8K = 8192 * 4  # characters: 4 per token, as the index assumes
TOKENS_100K = 100_000 * 4


def text(rng: np.random.Generator, chars: int) -> str:
    return rng.integers(32, 127, chars, dtype=np.uint8).tobytes().decode()


def timed(call, runs: int) -> tuple[float, float]:
    """P50 and P99 in microseconds."""
    for _ in range(min(50, runs)):
        call()
    samples = np.empty(runs)
    gc.disable()
    try:
        for i in range(runs):
            start = time.perf_counter_ns()
            call()
            samples[i] = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return float(np.percentile(samples, 50)) / 1e3, float(np.percentile(samples, 99)) / 1e3


def python_loop_hashes(prompt: str) -> list[int]:
    """The per-block loop this replaces: one xxh3 call per 64-byte block, chained."""
    data = prompt.encode()
    seed = xxhash.xxh3_64_intdigest(MODEL.encode())
    out = []
    for i in range(len(data) // 64):
        seed = xxhash.xxh3_64_intdigest(data[i * 64 : (i + 1) * 64], seed)
        out.append(seed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=31250, help="blocks per endpoint (lruCapacityPerServer)")
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    names = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(args.endpoints)]

    # --- build: fill every endpoint with distinct 128k-token prompts ------------------------------
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    index = PrefixIndex(args.capacity)
    filler = 128 * 1024 * 4  # one 128k-token prompt: 8192 blocks
    for name in names:
        while index.endpoint_size(name) < args.capacity:
            index.add(name, prompt_hashes(text(rng, filler), MODEL))
    # The prompts the queries share prefixes with (they evict as much of the filler).
    repeat = text(rng, TOKENS_8K)
    index.add(names[0], prompt_hashes(repeat, MODEL))
    shared = text(rng, TOKENS_8K)
    for name, chars in zip(names[1:4], (TOKENS_8K, 300 * 64, 123 * 64 + 10)):
        index.add(name, prompt_hashes(shared[:chars], MODEL))
    long_shared = text(rng, TOKENS_100K)
    index.add(names[4], prompt_hashes(long_shared[: 80_000 * 4], MODEL))
    index.add(names[5], prompt_hashes(long_shared[: 20_000 * 4 + 100], MODEL))
    build_seconds = time.perf_counter() - started
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    table = index._table
    print(f"index: {args.endpoints} endpoints x {args.capacity} blocks = {index.size:,} blocks (built in {build_seconds:.1f} s)")
    print(f"memory: {index.nbytes / 2**20:.1f} MiB in the index's numpy arrays (nbytes); "
          f"{traced / 2**20:.1f} MiB allocated for the build (tracemalloc); "
          f"table {table.slots:,} slots at {len(table) / table.slots:.0%} load")
    print()

    # --- hashing and matching -------------------------------------------------------------------
    cold_8k, cold_100k = text(rng, TOKENS_8K), text(rng, TOKENS_100K)
    partial_8k = shared[: 250 * 64] + text(rng, TOKENS_8K - 250 * 64)
    partial_100k = long_shared[: 50_000 * 4] + text(rng, TOKENS_100K - 50_000 * 4)
    cases = [
        ("8k tokens", "cold (no match)", cold_8k, args.runs),
        ("8k tokens", "repeat (1 endpoint, whole)", repeat, args.runs),
        ("8k tokens", "partial (3 endpoints, 2 lookups)", partial_8k, args.runs),
        ("100k tokens", "cold (no match)", cold_100k, max(100, args.runs // 10)),
        ("100k tokens", "partial (2 endpoints, 2 lookups)", partial_100k, max(100, args.runs // 10)),
    ]
    print(f"{'prompt':<12} {'case':<34} {'hash P50':>9} {'P99':>8} {'hash+match P50':>15} {'P99':>8}  matched blocks")
    for size, case, prompt, runs in cases:
        hash_only = timed(lambda: prompt_hashes(prompt, MODEL), runs)
        both = timed(lambda: index.matches(prompt_hashes(prompt, MODEL)), runs)
        found = index.matches(prompt_hashes(prompt, MODEL))
        shown = ", ".join(f"{n}" for n in sorted(found.values(), reverse=True)) or "-"
        print(f"{size:<12} {case:<34} {hash_only[0]:9.1f} {hash_only[1]:8.1f} {both[0]:15.1f} {both[1]:8.1f}  {shown}"
              f" of {len(prompt_hashes(prompt, MODEL))}")
    loop = timed(lambda: python_loop_hashes(cold_8k), max(100, args.runs // 10))
    print(f"{'8k tokens':<12} {'per-block Python xxh3 loop, hash':<34} {loop[0]:9.1f} {loop[1]:8.1f}")
    print()

    # --- add() ----------------------------------------------------------------------------------
    # Each timed call adds a fresh prompt, so the index stays full and every case evicts.
    prefix = text(rng, TOKENS_8K)
    target = names[10]
    index.add(target, prompt_hashes(prefix, MODEL))
    tails = iter([text(rng, 64 * 60) for _ in range(args.runs + 100)])
    fresh = iter([text(rng, TOKENS_8K) for _ in range(max(100, args.runs // 4) + 100)])
    held = prompt_hashes(prefix, MODEL)
    adds = [
        ("refresh: 512 blocks, all held", lambda: index.add(target, held), args.runs),
        ("shared: 452 held + 60 new blocks", lambda: index.add(target, prompt_hashes(prefix[: 452 * 64] + next(tails), MODEL)), args.runs),
        ("new: 512 new blocks, 512 evicted", lambda: index.add(target, prompt_hashes(next(fresh), MODEL)), max(100, args.runs // 4)),
    ]
    print(f"{'add() of an 8k-token prompt':<40} {'P50':>8} {'P99':>8}   (includes hashing the prompt, except refresh)")
    for case, call, runs in adds:
        p50, p99 = timed(call, runs)
        print(f"{case:<40} {p50:8.1f} {p99:8.1f}")
    assert index.size == args.endpoints * args.capacity


if __name__ == "__main__":
    main()
