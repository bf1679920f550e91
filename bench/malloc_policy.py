"""What glibc malloc keeps of a tokenizing picker's memory, under each allocator policy, side by side.

The precise producer encodes prompts with HF ``tokenizers`` on threads (``epp-tokenize``). The Rust
side allocates per word while it encodes (a pre-tokenizer split: its strings and alignments, in
vectors grown by ``realloc``: those ``perf`` saw mapped in a soak were 1.1 MiB) and frees it all
before it returns. glibc keeps what was freed in its heaps, resident, for later allocations; and its
default *dynamic* mmap threshold rises to the size of every mapped block freed (up to 32 MiB), its
trim threshold following at twice that, so that the large vectors too end up in the heaps. This
bench measures what stays, in one process per policy, with the picker's own tokenizer path
(:class:`epp.prefix.tokenize.ModelTokenizer`, plans finished on a two-thread pool as the producer
does) and ``bench/soak.py``'s precise mix of new prompts (conversations of up to 6 turns under
0.5-20 KB system prompts, 1-20 KB completions):

1. ``--requests`` prompts of the mix (the allocator's warm-up);
2. one chat request of ``--long-tokens`` tokens (a 100k-token prompt by default), then ``--requests``
   more of the mix: what the long prompt left behind;
3. ``--requests`` more: whether the resident size keeps rising.

Printed per policy after each phase: RSS, the heaps' bytes and their free part, mapped bytes
(``mallinfo2``), and CPU per request (the process's, threads included). Policies:

* ``glibc``: glibc's own defaults (arenas up to 8 per core, dynamic thresholds);
* ``arenas2``: at most 2 arenas, dynamic thresholds (the picker before it released anything);
* ``picker``: the picker's policy (below);
* ``fixed:M:T``: at most 2 arenas, the mmap threshold fixed at M KiB and the trim threshold at T KiB.

``picker`` is the picker as it runs: at most 2 arenas (``epp.server.process.limit_malloc_arenas``) and
its heaps' free pages released after an encoding of more than 64k tokens
(:mod:`epp.prefix.tokenize`, "Memory after a long prompt"; the releases are counted and timed); the
others release nothing, as the picker before that.

    python bench/malloc_policy.py [--policies glibc,arenas2,picker] [--requests 1500] [--rounds 1]

Each (policy, round) is its own process, the rounds' order rotated; medians over rounds, and each
round's RSS. Results (``--requests 400 --rounds 3 --policies arenas2,picker,fixed:1024:2048``, 2
shared cores) are quoted in :mod:`epp.prefix.tokenize` ("Memory after a long prompt"): the long
prompt left ~23 MiB resident under 2 arenas and under fixed thresholds alike, ~2 MiB with the
picker's release.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/ is not a package)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _apply(policy: str) -> None:
    if policy == "glibc":
        return
    from epp.server.process import limit_malloc_arenas

    limit_malloc_arenas()  # the picker's cap, under every other policy
    if policy.startswith("fixed:"):
        _, mmap_kib, trim_kib = policy.split(":")
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_kib) * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, int(trim_kib) * 1024)
    elif policy not in ("arenas2", "picker"):
        raise SystemExit(f"unknown policy {policy!r}")


def _child(policy: str, requests: int, long_tokens: int, seed: int) -> None:
    _apply(policy)  # first: before any thread allocates
    from soak import _MODEL, _precise_mix, _text

    from epp.prefix import tokenize
    from epp.prefix.tokenize import ModelTokenizer
    from epp.sim.tokens import write_model_files

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    with tempfile.TemporaryDirectory() as directory:
        tok = ModelTokenizer.from_dir(write_model_files(Path(directory) / "model"))
    pool = ThreadPoolExecutor(2, thread_name_prefix="epp-tokenize")
    mix = (item for item in _precise_mix(random.Random(seed), 0) if item[0] == "POST" and item[3] == 200)

    release = tokenize._RELEASE
    trims: list[float] = []
    if policy == "picker":  # timed: the release as the picker makes it, after long encodings
        trim = release._trim
        assert trim is not None, "glibc's malloc_trim is needed here"

        def timed(pad: int) -> int:
            start = time.perf_counter()
            try:
                return trim(pad)
            finally:
                trims.append(time.perf_counter() - start)

        release._trim = timed
    else:
        release._trim = None  # the others: as the picker was before it released anything

    def one(path: str, body: bytes) -> None:
        plan = tok.plan("chat_completions" if path.endswith("chat/completions") else "completions", body)
        pool.submit(plan.finish).result() if plan.pending else plan.finish()

    def phase(name: str, long: bool) -> dict[str, float | str]:
        start = time.process_time()
        count = 0
        if long:
            body = json.dumps(
                {
                    "model": _MODEL,
                    "messages": [{"role": "user", "content": _text(random.Random(seed), long_tokens * 4)}],
                }
            )
            one("/v1/chat/completions", body.encode())
            count += 1
        for _ in range(requests):
            _, path, body, _ = next(mix)
            assert body is not None
            one(path, body)
            count += 1
        info = libc.mallinfo2()
        return {
            "phase": name,
            "rss": _rss() / 2**20,
            "heaps": info.arena / 2**20,
            "free": info.fordblks / 2**20,
            "mapped": info.hblkhd / 2**20,
            "cpu_ms": (time.process_time() - start) * 1e3 / count,
            "trims": len(trims),
            "trim_ms": max(trims, default=0.0) * 1e3,
        }

    rows = [phase("mix", False), phase("long+mix", True), phase("mix again", False)]
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="glibc,arenas2,picker")
    parser.add_argument("--requests", type=int, default=1500, help="prompts of the mix per phase")
    parser.add_argument("--long-tokens", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.requests, args.long_tokens, args.seed)
        return
    policies = args.policies.split(",")
    results: dict[str, list[list[dict[str, float | str]]]] = {p: [] for p in policies}
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    for r in range(args.rounds):
        for policy in policies[r % len(policies) :] + policies[: r % len(policies)]:
            out = subprocess.run(
                [sys.executable, __file__, "--child", policy, "--requests", str(args.requests),
                 "--long-tokens", str(args.long_tokens), "--seed", str(args.seed)],
                env=environment, capture_output=True, text=True, check=True,
            )  # fmt: skip
            results[policy].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {policy}: done", file=sys.stderr)
    print(f"{args.requests} prompts a phase; the long prompt {args.long_tokens} tokens; medians of {args.rounds}"
          " round(s); MiB")  # fmt: skip
    print(
        f"{'policy':<20} {'phase':<10} {'RSS':>8} {'heaps':>8} {'free':>7} {'mapped':>7} {'CPU ms/req':>11} "
        f"{'trims':>6} {'max trim ms':>11}  RSS by round"
    )
    for policy, runs in results.items():
        for i, row in enumerate(runs[0]):
            med = {k: statistics.median(float(run[i][k]) for run in runs) for k in row if k != "phase"}
            print(f"{policy:<20} {row['phase']!s:<10} {med['rss']:8.1f} {med['heaps']:8.1f} {med['free']:7.1f} "
                  f"{med['mapped']:7.1f} {med['cpu_ms']:11.2f} {med['trims']:6.0f} {med['trim_ms']:11.2f}  "
                  + " ".join(f"{float(run[i]['rss']):.1f}" for run in runs))  # fmt: skip


if __name__ == "__main__":
    main()
