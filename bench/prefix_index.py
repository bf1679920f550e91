"""How fast the prefix-cache index hashes and matches, what add() costs, and how much memory it holds.

    python bench/prefix_index.py [--endpoints 64] [--capacity 31250] [--runs 2000]

Builds a full index (every endpoint at exactly its capacity, no block shared between endpoints:
the worst case for memory; the endpoints are registered first, as the plugin does when the pool
changes), then times, with a fixed seed:
  * hash only, and hash + match, for an 8k-token (32 KB) and a 100k-token (400 KB) prompt that
    match nothing (new), match one endpoint whole (repeat), or are a family's prompt: a shared
    prefix several endpoints hold to different depths, then a new question, parting from the
    shared text where runs ended before (one lookup) or somewhere new (two lookups);
  * add() of an 8k-token prompt, with its hashes computed beforehand (on the request path the
    producer hashed the prompt to match it): all blocks already held (refresh), a shared prefix
    plus 60 new blocks, and 512 new blocks (evicting as many). "add" alone looks the prompt up
    itself; "match+add" is what the plugin does per request (look up, pick, add: add() then
    reuses the lookup), shown as the add() part and as the whole;
  * a pod joining the full index: its first add (which, as the 65th endpoint, needs a second
    mask word and so starts a table migration) and the slowest add() while that migration runs;
  * memory: the index's numpy arrays (nbytes) and what tracemalloc saw allocated for the build.
For scale it also times the per-block Python loop of xxh3 calls that hashing replaces.
Numbers are microseconds, P50 / P99 / max over --runs calls. The machine is shared: compare
medians of a few runs, not one.
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import xxhash

from epp.prefix import PrefixIndex, PrefixLookup, prompt_hashes

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TOKENS_8K = 8192 * 4  # characters: 4 per token, as the index assumes
TOKENS_100K = 100_000 * 4
BLOCK = 64  # characters per block (16 tokens)


def text(rng: np.random.Generator, chars: int) -> str:
    return rng.integers(32, 127, chars, dtype=np.uint8).tobytes().decode()


def timed(
    call: Callable[[], object], runs: int, setup: Callable[[], object] | None = None
) -> tuple[float, float, float]:
    """P50, P99 and max in microseconds (``setup`` runs before each call, untimed)."""
    for _ in range(min(20, runs)):
        if setup:
            setup()
        call()
    samples = np.empty(runs)
    gc.disable()
    try:
        for i in range(runs):
            if setup:
                setup()
            start = time.perf_counter_ns()
            call()
            samples[i] = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return float(np.percentile(samples, 50)) / 1e3, float(np.percentile(samples, 99)) / 1e3, float(samples.max()) / 1e3


def python_loop_hashes(prompt: str) -> list[int]:
    """The per-block loop this replaces: one xxh3 call per 64-byte block, chained."""
    data = prompt.encode()
    seed = xxhash.xxh3_64_intdigest(MODEL.encode())
    out = []
    for i in range(len(data) // 64):
        seed = xxhash.xxh3_64_intdigest(data[i * 64 : (i + 1) * 64], seed)
        out.append(seed)
    return out


def fill(index: PrefixIndex, name: str, capacity: int, rng: np.random.Generator) -> None:
    """Fill an endpoint to exactly its capacity with distinct 128k-token prompts (8192 blocks)."""
    while index.endpoint_size(name) < capacity:
        blocks = min(8192, capacity - index.endpoint_size(name))
        index.add(name, prompt_hashes(text(rng, blocks * BLOCK), MODEL))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=31250, help="blocks per endpoint (lruCapacityPerServer)")
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    names = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(args.endpoints)]

    # --- build: every endpoint full of distinct blocks -----------------------------------------
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    index = PrefixIndex(args.capacity)
    for name in names:
        index.set_capacity(name, args.capacity)
    # The prompts the queries share prefixes with (blocks of the fill then make up the rest).
    repeat = text(rng, TOKENS_8K)
    index.add(names[0], prompt_hashes(repeat, MODEL))
    shared = text(rng, TOKENS_8K)
    for name, chars in zip(names[1:4], (TOKENS_8K, 300 * BLOCK, 123 * BLOCK + 10), strict=True):
        index.add(name, prompt_hashes(shared[:chars], MODEL))
    long_shared = text(rng, TOKENS_100K)
    index.add(names[4], prompt_hashes(long_shared[: 80_000 * 4], MODEL))
    index.add(names[5], prompt_hashes(long_shared[: 20_000 * 4 + 100], MODEL))
    for name in names:
        fill(index, name, args.capacity, rng)
    while index._store.migrating:  # let a growth still under way finish (a step per update)
        index._maintain()
    build_seconds = time.perf_counter() - started
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    store = index._store
    print(f"index: {args.endpoints} endpoints x {args.capacity} blocks = {index.size:,} blocks "
          f"(built in {build_seconds:.1f} s)")
    print(f"memory: {index.nbytes / 2**20:.1f} MiB in the index's numpy arrays (nbytes); "
          f"{traced / 2**20:.1f} MiB allocated for the build (tracemalloc); "
          f"table {store.slots:,} slots of {store.slot_bytes} bytes at {store.live / store.usable:.0%} load, "
          f"{store.spilled} spilled")
    print()

    # --- hashing and matching -------------------------------------------------------------------
    # Each timed call hashes and matches a prompt made just before it (untimed, so it is fresh in
    # the cache as a just-parsed request body is), new at every call but in the "repeat" case.
    # "family" prompts are a prefix of a text that two endpoints hold whole (8k: and one to block
    # 123; 100k: one to block 1251), then a new question. The index learns where runs end and
    # looks there first: "new question" parts from the text at the same block every time (250;
    # 100k: 3125), so one lookup finds every run; "parts somewhere new" parts at one of 97
    # blocks in turn, so the runs of the two endpoints holding the text end where the index has
    # not seen one end lately, and a second lookup finds them.
    questions = [text(rng, TOKENS_8K) for _ in range(64)]
    questions_100k = [text(rng, TOKENS_100K) for _ in range(8)]
    cold_8k = text(rng, TOKENS_8K)
    prompt: list[str] = [""]

    def making(make: Callable[[int], str]) -> Callable[[], None]:
        count = iter(range(1 << 62))

        def setup() -> None:
            prompt[0] = make(next(count))

        return setup

    def cold(i: int) -> str:  # a new prompt nobody holds (its first block differs from all)
        return f"{i:08d}" + cold_8k[8:]

    def cold_non_ascii(i: int) -> str:  # the same with one CJK character: a slower str.encode
        return f"{i:08d}" + cold_8k[8:-1] + "\u4e00"

    def cold_100k(i: int) -> str:
        return f"{i:08d}" + questions_100k[i % 8][8:]

    def family(held: str, questions: list[str], parts: Callable[[int], int], size: int) -> Callable[[int], str]:
        def make(i: int) -> str:
            at = parts(i) * BLOCK
            return held[:at] + questions[i % len(questions)][at + 8 : size] + f"{i:08d}"

        return make

    runs_100k = max(100, args.runs // 10)
    cases = [
        ("8k tokens", "new, no match", making(cold), args.runs),
        ("8k tokens", "new, one non-ASCII character", making(cold_non_ascii), args.runs),
        ("8k tokens", "repeat (1 endpoint, whole)", making(lambda i: repeat), args.runs),
        ("8k tokens", "family, new question", making(family(shared, questions, lambda i: 250, TOKENS_8K)), args.runs),
        ("8k tokens", "family, parts somewhere new",
         making(family(shared, questions, lambda i: 150 + i % 97, TOKENS_8K)), args.runs),
        ("100k tokens", "new, no match", making(cold_100k), runs_100k),
        ("100k tokens", "family, new question",
         making(family(long_shared, questions_100k, lambda i: 3125, TOKENS_100K)), runs_100k),
        ("100k tokens", "family, parts somewhere new",
         making(family(long_shared, questions_100k, lambda i: 3000 + i % 97 * 10, TOKENS_100K)), runs_100k),
    ]
    print(f"{'prompt':<12} {'case':<34} {'hash P50':>9} {'P99':>8} {'hash+match P50':>15} {'P99':>8}  matched blocks")
    for size, case, setup, runs in cases:
        hash_only = timed(lambda: prompt_hashes(prompt[0], MODEL), runs, setup)
        both = timed(lambda: index.matches(prompt_hashes(prompt[0], MODEL)), runs, setup)
        setup()
        found = index.matches(prompt_hashes(prompt[0], MODEL))
        shown = ", ".join(f"{n}" for n in sorted(found.values(), reverse=True)) or "-"
        print(f"{size:<12} {case:<34} {hash_only[0]:9.1f} {hash_only[1]:8.1f} {both[0]:15.1f} {both[1]:8.1f}  {shown}"
              f" of {len(prompt_hashes(prompt[0], MODEL))}")
    loop = timed(lambda: python_loop_hashes(cold_8k), max(100, args.runs // 10))
    print(f"{'8k tokens':<12} {'per-block Python xxh3 loop, hash':<34} {loop[0]:9.1f} {loop[1]:8.1f}")
    print()

    # --- add() ----------------------------------------------------------------------------------
    # Each timed call adds a fresh prompt (hashed beforehand), so the index stays full and the
    # "new" cases evict: a batch every few calls, which the P99 and max show.
    target = names[10]
    prefix = text(rng, TOKENS_8K)
    held = prompt_hashes(prefix, MODEL)
    index.add(target, held)
    shared_runs, new_runs = args.runs, max(100, args.runs // 4)
    queue: list[np.ndarray] = []

    def prepare(make: Callable[[], np.ndarray], count: int) -> Callable[[], None]:
        queue.extend(make() for _ in range(count + 40))
        return lambda: None

    def next_hashes() -> np.ndarray:
        return queue.pop()

    current: list[np.ndarray] = []
    looked_up: list[PrefixLookup] = []

    def load() -> None:
        current[:] = [next_hashes()]

    def add_alone() -> None:
        index.add(target, current[0])

    def match_then_add() -> None:
        lookup = index.lookup(current[0])
        lookup.matches.get(target, 0)
        index.add(target, current[0], lookup=lookup)

    def add_after_match() -> None:  # times add() only; its lookup runs in setup
        index.add(target, current[0], lookup=looked_up[0])

    def load_and_match() -> None:
        load()
        lookup = index.lookup(current[0])
        lookup.matches.get(target, 0)
        looked_up[:] = [lookup]

    def shared_prompt() -> np.ndarray:
        return prompt_hashes(prefix[: 452 * BLOCK] + text(rng, 60 * BLOCK), MODEL)

    def new_prompt() -> np.ndarray:
        return prompt_hashes(text(rng, TOKENS_8K), MODEL)

    print(f"{'add() of an 8k-token prompt (hashed before)':<44} {'':<12} {'P50':>8} {'P99':>8} {'max':>8}")
    for case, make, runs in (
        ("refresh: 512 blocks, all held", lambda: held, args.runs),
        ("shared: 452 held + 60 new blocks", shared_prompt, shared_runs),
        ("new: 512 new blocks, evicting as many", new_prompt, new_runs),
    ):
        for how, call, setup in (
            ("add", add_alone, load),
            ("match+add: add", add_after_match, load_and_match),
            ("match+add", match_then_add, load),
        ):
            prepare(make, runs)
            p50, p99, worst = timed(call, runs, setup)
            queue.clear()
            print(f"{case:<44} {how:<15} {p50:8.1f} {p99:8.1f} {worst:8.1f}")
    assert index.size == sum(index.endpoint_size(name) for name in names)
    print()

    # --- a pod joins the full index -------------------------------------------------------------
    # As the plugin does: the pod is registered when it joins the pool (its capacity), and gets
    # picked later. As the 65th endpoint it needs a second mask word: registering it prepares a
    # wider table, which the following updates warm up and move the keys into, a bounded step
    # each; its own first add() waits for nothing if that is done by then.
    newcomer = "10.9.0.1:8000"
    start = time.perf_counter_ns()
    index.set_capacity(newcomer, args.capacity)
    registered = (time.perf_counter_ns() - start) / 1e3
    prompts = [prompt_hashes(text(rng, TOKENS_8K), MODEL) for _ in range(64)]
    during: list[float] = []
    gc.disable()
    try:
        while index._upkeep.busy:
            start = time.perf_counter_ns()
            index.add(names[len(during) % len(names)], prompts[len(during) % len(prompts)])
            during.append((time.perf_counter_ns() - start) / 1e3)
        first = prompt_hashes(text(rng, TOKENS_8K), MODEL)
        start = time.perf_counter_ns()
        index.add(newcomer, first)
        joined = (time.perf_counter_ns() - start) / 1e3
    finally:
        gc.enable()
    steps = np.array(during or [0.0])
    print(f"a pod joins ({len(names) + 1}th endpoint, a second mask word): registering it {registered:.0f} µs; "
          f"the table then grew over {len(during)} add() calls (512 new blocks each): "
          f"P50 {np.percentile(steps, 50):.0f}, P99 {np.percentile(steps, 99):.0f}, max {steps.max():.0f} µs; "
          f"its first add() {joined:.0f} µs; memory now {index.nbytes / 2**20:.1f} MiB "
          f"({index._store.words} mask words)")


if __name__ == "__main__":
    main()
