"""Soak: does the picker's memory stay flat over a long run of mixed traffic?

A real Envoy with the reference ext_proc configuration, the picker (``python -m epp serve``) and
simulated vLLM pods (``python -m epp.sim``), all on 127.0.0.1. ``--workers`` clients send, for
``--minutes`` (default 30), a fixed mix in turn: chat completions non-streamed and streamed,
completions non-streamed and streamed, a body that is not JSON (the picker's 400) and
``GET /v1/models``. Every ``--interval`` seconds the picker's RSS and open file descriptors (from
/proc, the main process only: the scrape worker is a separate process with its own heap) are sampled
with the number of requests answered so far.

The result is the slope of RSS against requests, a least-squares line over the samples after the
first ``--warmup`` fraction of the run (caches, pools and the allocator's arenas fill first), in
bytes per request, and the same for fds; the target is <= 1 byte per request over 30 minutes. Below
it, the slope fitted from later starts (40 / 50 / 60 / 75% of the run) and the medians of the thirds
after the warm-up (with ``--picker-arg=--workers=N``, the owner's too): a step or the end of a fill
shows there as one change and a trend as several. A PNG plot (``--plot``, default soak.png) shows RSS
and fds against requests with the fitted line.

    python bench/soak.py [--minutes 30] [--workers 4] [--interval 5] [--plot soak.png]
                         [--picker-arg=--flag=value ...] [--tls] [--observe]
                         [--precise [--prefix-cache-bytes N]] [--picker-env NAME=VALUE ...]

(``--tls``: the picker serves TLS, upstream's default, to an Envoy that uses it; ``--observe``: Envoy
observes responses, ``epp envoy-config --observe-responses``, a second ext_proc stream a request.)
With ``--picker-arg=--workers=N`` the picker's ext_proc workers are sampled too: RSS, fds and CPU are
the main process's and its workers' together (the scrape worker still left out), and the output adds
each process's growth and slope (a restarted worker shows as a new pid).

``--precise``: the pods publish KV events and the picker runs ``precise-prefix-cache-producer`` with
the simulated model's own tokenizer files (as ``bench/precise_routing.py`` does), and every prompt is
new: each client holds a conversation of up to 6 turns under a system prompt of its own (0.5-12 KB,
every tenth 20 KB: cold heads, rests encoded on the loop and on the threads, prompts over 16 KiB),
and sends unique completions (1-20 KB) between turns; the pods' caches are small enough to evict.
What is bounded then fills during the warm-up: the tokenizer's prefix cache (8 MiB here,
``prefixCacheBytes``), the index (the pods' own blocks), the in-flight record (its TTL).
Measured (``python bench/soak.py --precise --minutes 30``, at aaa15f4, 2 pods): 409,457 requests
(227/s), picker CPU 3.05 ms a request; RSS 96.0 MiB at start, 142.6 after warm-up, 146.9 at the end: a
slope of 3.95 bytes a request over the 327,881 after warm-up, fds 37-39. Again at e43b67b, whose picker
caps glibc malloc at 2 arenas (``epp/server/process.py``: without the cap the tokenizer threads' arenas
crept; side by side, 8.6 bytes a request against 3.0): 403,979 requests (224/s), CPU 3.03 ms a request,
RSS 95.8 MiB at start, 115.2 after warm-up, 114.2 at the end, a slope of 1.81 bytes a request (fitted
after 30 / 40 / 50% of the run instead of 20: 2.24 / 2.41 / 3.11). For an hour at 46a054f (``--minutes
60``, beside a default-path soak: 121 requests/s): 435,275 requests, CPU 3.60 ms a request, RSS 113.2
MiB two minutes in and 110.8-114.2 from the warm-up to the end, no trend (the medians of the first and
last thirds after the warm-up 113.30 and 113.32 MiB), a slope of **0.72 bytes a request** (fitted after
30 / 40 / 50% of the run: 0.05 / 1.28 / 3.90: the heaps' wandering, MiBs either way, outweighs any
trend at this length). Its first version wrote words
the model files do not know: the picker's ids were then not the pods', no event confirmed a block sent,
and the in-flight record held every request's blocks for its TTL (RSS 95 -> 410 MiB in a minute),
which is what bounds that record now.

Talks only to 127.0.0.1; stops by itself. Bounded: ``--workers`` requests in flight at a time.

Measured (``python bench/soak.py --minutes 30``, 2 pods, the 2-core development machine): 1,138,154
requests (632/s), picker CPU 0.41 ms per request; RSS 76.6 MiB after warm-up, 76.7 at the end: a slope
of **0.07 bytes per request** over the 922,447 requests after warm-up, fds 19-21 throughout. For an
hour at 46a054f (glibc's arenas capped since fa5dfc6; ``--minutes 60``, beside a precise soak): 1,427,176
requests (396/s), CPU 0.42 ms a request, RSS 77.4 MiB after warm-up and at the end: **0.01 bytes a
request**, fds 20-23. Under
grpc.aio (c519aee and before) the same bench grew 95-108 bytes per request (grpc/grpc#43360: the
native ops of every batch a reset cancels), 14 with a workaround; ``epp.wire`` has no such path.

``--workers`` and observed responses, the first soaks of either (at 5986138's code; two soaks side by
side each time on the 2 shared cores, so the rates are low and a run holds fewer requests than the
runs above; slopes of the main process and its two workers together):

* ``--observe --picker-arg=--workers=2``, 30 min: 193,212 requests (107/s), CPU 2.00 ms a request; RSS
  172.2 MiB after warm-up, 172.3 at the end (+0.17 MiB over 149,648 requests): **1.20 bytes a request**
  (the owner 0.73, the workers 0.14 and 0.33; fitted after 30 / 40 / 50 / 67%: 1.22 / 1.28 / 1.30 /
  1.46), fds 55-62. The owner's Python heap did not grow: the same load for 13 minutes with
  ``tracemalloc`` started in the owner (a ``sitecustomize`` on ``PYTHONPATH``), its traced memory 38.32,
  38.32 and 38.29 MB at 2.6, 5.3 and 7.9 minutes past a baseline taken 4 minutes in, no line of epp's
  among the growers: what grows is the C heap's, some 0.1-0.2 MiB a half hour.
* the same with ``--tls`` (TLS in C, :class:`epp.wire._fast.TlsTransport`), 45 min, ``--warmup 0.3``:
  231,499 requests (86/s), CPU 2.35 ms a request; RSS 177.9 MiB after warm-up, 178.2 at the end (+0.37
  MiB over 188,664 requests): 2.14 bytes a request (the owner 0.43, the workers 0.73 and 0.97; fitted
  after 40 / 50 / 60 / 75%: 1.87 / 1.58 / 1.42 / 0.86), fds 55-62; the medians of the last 60%'s thirds
  178.04, 178.15 and 178.25 MiB: a slow rise, not settled in 45 minutes.
* ``--precise --picker-arg=--workers=2`` (the bodies go to the owner, which tokenizes), 45 min,
  ``--warmup 0.4``: 82,795 requests (31/s), CPU 9.44 ms a request; RSS 203.9 MiB after warm-up, 205.4 at
  the end (+1.46 MiB over 57,898 requests): **32.8 bytes a request**, all the owner's (31.5; the workers
  0.55 and 0.75), in steps of ~0.7 MiB (a 30-minute run before it: 32.6). Not Python's: under
  ``tracemalloc`` (11 minutes, in the owner) its traced memory was 51.3, 51.9, 52.5 and 51.0 MB at 1.7,
  3.5, 5.3 and 7.1 minutes past a baseline, its growers the bounded caches filling and emptying (the
  tokenizer's prefix cache, the in-flight record). The one-process precise soaks above ran 400-435k
  requests at 121-227/s (1.81 and 0.72 bytes a request); this one 83k at 31/s, and whether the owner's C
  heap (prompt ids, bodies, the tokenizer's own allocations) levels off past that is not shown: an hour
  with the machine to itself, or the same low rate in one process beside it, is what would tell.
* The same with the machine to itself (at 511f978, ``--minutes 40 --warmup 0.3``): 163,211 requests
  (68/s), 9.56 ms a request; RSS 206.4 -> 207.5 MiB after the warm-up: **12.83 bytes a request**, the
  owner's 11.99 (112.2 -> 113.4 MiB; fitted after 50 / 60 / 75%: 14.0 / 15.4 / 14.5), the workers'
  0.37 / 0.47. Still rising at the end, by ~0.2-0.5 MiB each 10 minutes. Where, in the owner
  (``/proc/PID/smaps`` each minute; glibc's heaps walked from ``/proc/PID/mem`` and read with
  ``malloc_info`` through gdb): the main heap grew 32.7 -> 38.4 MiB in the first 10 minutes, then
  0.2 MiB in 25; its chunks in use did not grow (32.24 -> 32.03 MiB over 7 minutes), its unused top
  did; later growth was spread (the second arena, the threads', +0.8 MiB, a new 2 MiB mapping). Python's
  allocator is not it either: ``sys._debugmallocstats()`` each minute in the owner (a sitecustomize
  probe, the same load for 18 minutes, 64 requests/s, 15.4 bytes a request) showed 29 arenas of 1 MiB at the
  first sample and 30 at every one after, 29.1-30.0 MB in blocks, no trend.
* Nor glibc's policy. Three soaks side by side (``--minutes 35 --warmup 0.3``, each 50.5k requests at
  24/s): as shipped (2 arenas; glibc's mmap threshold had risen to 4.2 MB and its trim threshold to 8.4
  MB within 7 minutes, read from ``mp_`` with glibc's debug symbols), **19.88** bytes a request; with
  both thresholds fixed (``MALLOC_MMAP_THRESHOLD_=1048576 MALLOC_TRIM_THRESHOLD_=2097152``) **15.87**;
  with one arena (``MALLOC_ARENA_MAX=1``) **30.11**; CPU 9.36 / 9.34 / 9.64 ms a request. (What a single
  long prompt leaves behind is another matter, found on the way and fixed: ``bench/malloc_policy.py``.)
* Nor glibc at all: three soaks side by side with another allocator preloaded into the picker alone
  (``--picker-env LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2``, Debian's jemalloc 5.3 and
  mimalloc 2.0; at 84aa65f, ``--minutes 28 --warmup 0.3``, each ~43k requests at 26/s): RSS +2.17 / +2.59
  / +1.83 MiB after the warm-up, **56.8 / 39.3 / 65.9 bytes a request** (glibc, jemalloc, mimalloc; the
  owners' 54.7 / 36.1 / 58.3), CPU 8.95 / 8.80 / 8.02 ms a request. Three allocators, each with its own
  way of keeping and returning free memory, grew alike: most likely memory in use rather than memory
  kept free, allocated outside Python's allocator (which ``tracemalloc`` and the pymalloc probe above
  saw flat). ``heaptrack -p`` attached to the owner 2.5 minutes into a 16-minute soak (alone, 40
  requests/s under the tracer) counted 14.7 MB allocated while it watched and not freed at the end:
  7 MB of numpy arrays (the tokenizer's prefix cache, 8 MiB, refilled meanwhile) and 5.6 MB in HF
  tokenizers' encoding (its pre-tokenizer's split vectors, its regex engines'), which cannot be a leak:
  the owner's RSS rose 0.5 MiB from the warm-up's end (minute 5) to the run's, and the tokenizer alone, encoding 600 fresh random texts of 100-3,000 words a
  round with ``malloc_trim`` after each, stayed at 83.4-83.5 MiB for 8 rounds (a tracer injected into
  a running process can miss frees). The cause is still not found; what it is not is written above.
* Nor ``--workers``: side by side with one process at the same rate, the owner grows as one process
  does. Two pairs at 561abd6 (``--precise --minutes 25 --warmup 0.3 --picker-arg=--workers=2`` beside
  ``--precise --minutes 20 --warmup 0.3`` started 7 minutes later; then the same two at ``--minutes
  28``), 38-45 requests a second each: the owner **11.87** and **20.76** bytes a request, the one
  process **23.35** and **16.74**. Between the pairs, two one-process soaks side by side (``--precise
  --minutes 20 --warmup 0.3``, one with ``--prefix-cache-bytes 0``): **0.97** as shipped (109.4 MiB
  after the warm-up and at the end), 17.17 without the prefix cache. The same configuration read
  0.97 and 23.35 within the hour: at ~40 requests a second a 20-30 minute soak's slope is a reading of
  a few steps of 0.3-0.7 MiB (and the end of the caches' fill), ~0.5-0.9 KB a second when they come,
  and whether they come in the window decides it. The owner of the first pair, fitted from 50 / 60 /
  75% of the run instead (printed now below the slope), read 1.16 / 0.32 / 0.67 (one step of 0.3 MiB
  at ~40k requests, flat for the last 25k); the second's 26.1 / 24.6 / 22.6 (its thirds' medians
  110.64 / 110.87 / 111.27 MiB). So the higher figures ``--workers 2`` read above came from its rate:
  its CPU a request (9.2-9.5 ms here against 8.4-8.5 in one process) and two soaks sharing the cores
  gave it 26-68 requests a second where the one-process precise soaks above ran 121-227, and growth
  that comes per unit of time reads larger per request at a lower rate. Two parts ruled out each
  alone (throwaway scripts, not in the repo): the worker-owner channel (both ends in one process on
  uvloop, a stand-in director, 20k routes a round with bodies of 0.5-20 KB) held RSS at 90,632-90,764
  kB over 240k routes (small bodies: 84,360-84,488 over 400k); the KV-event subscriber under
  ``bench/kvevents_lag.py``'s storm (51k blocks stored and removed a second) for 8 minutes, 3.06M
  events, rose 0.5 MiB in its first 2 minutes and not at all in the 6 after.
* Nor the mmap threshold at that rate. glibc's fixed at its starting 128 KiB (``--picker-env
  MALLOC_MMAP_THRESHOLD_=131072``: buffers of the steps' size mapped and unmapped, not left in the heap;
  ``epp/server/process.py`` has it at 103-108 requests a second) beside the picker as shipped, at
  5b092d7 (``--precise --minutes 25 --warmup 0.3``, 43 requests a second each, ~47k requests after the
  warm-up): **7.50** bytes a request with the threshold fixed (fitted from 40 / 50 / 60 / 75%: 5.26 /
  0.63 / 0.09 / 8.79; thirds' medians 104.60 / 104.83 / 104.82 MiB), **-0.99** as shipped (108.6 MiB
  after the warm-up, 108.1 at the end; thirds 108.65 / 108.77 / 108.56), CPU 7.98 against 7.48 ms a
  request. The fixed threshold keeps RSS ~4 MiB lower and costs 7% more CPU; the slope is the same
  reading of a step or two either way.

Against the target (<= 1 byte a request over 30 minutes): met without precise routing (one process
0.01-0.07; ``--workers 2`` with observed responses 1.2, 2.1 with TLS); with precise routing, met in one
process at 121-227 requests a second (0.72 over an hour, 1.81); at ~40, in two of five one-process runs
(0.97 and -0.99; the others 16.7-23.4) and in neither run under ``--workers 2`` (11.9, 20.8): the same
growth in time, see "Nor ``--workers``".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp

from epp.envoy.bootstrap import BootstrapOptions, render
from epp.sim.tokens import write_model_files
from epp.testing.envoy import EnvoyProcess
from epp.testing.harness import PickerProcess, child_pids, cpu_seconds, wait_for_picker

# Off by default up to Envoy 1.40 at least: Envoy then ends each ext_proc stream with a half-close and a reset.
_GRACEFUL_CLOSE = "envoy.reloadable_features.ext_proc_graceful_grpc_close"
_MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # the simulator's default served model


@dataclass
class Sample:
    seconds: float
    requests: int
    rss: int  # the picker's ext_proc processes together: the main one and, under --workers, its workers
    fds: int
    processes: dict[str, int] = field(default_factory=dict)  # RSS by process ("main", "worker 0"...)


def _worker_pids(pid: int) -> list[int]:
    """The picker's ext_proc worker processes (``--workers``), in spawn order; not its scrape worker."""
    pids = []
    for child in child_pids(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"epp.server.workers" in command:
            pids.append(child)
    return sorted(pids)


def _measure(pid: int, seconds: float, requests: int) -> Sample:
    """One sample of the main process and its ext_proc workers (a worker gone between the listing and the
    reading, restarted, is left out of this sample: its successor's pid differs, which the output shows)."""
    processes = {"main": _rss(pid)}
    fds = _fds(pid)
    for i, worker in enumerate(_worker_pids(pid)):
        try:
            rss, worker_fds = _rss(worker), _fds(worker)
        except (FileNotFoundError, RuntimeError):
            continue
        processes[f"worker {i} ({worker})"] = rss
        fds += worker_fds
    return Sample(seconds, requests, sum(processes.values()), fds, processes)


def _cpu(pid: int) -> float:
    """CPU seconds of the picker's ext_proc processes: the main one and its workers, not the scrape worker."""
    return cpu_seconds(pid, children=False) + sum(cpu_seconds(w, children=False) for w in _worker_pids(pid))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _mix() -> list[tuple[str, str, bytes | None, int]]:
    """(method, path, body, expected status) of one round of the mix."""
    messages = [{"role": "user", "content": "tell me about the quick brown fox " * 8}]
    chat = {"model": _MODEL, "messages": messages, "max_tokens": 16}
    completion = {"model": _MODEL, "prompt": "the quick brown fox jumps over the lazy dog " * 8, "max_tokens": 16}
    return [
        ("POST", "/v1/chat/completions", json.dumps(chat).encode(), 200),
        ("POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode(), 200),
        ("POST", "/v1/completions", json.dumps(completion).encode(), 200),
        ("POST", "/v1/completions", json.dumps({**completion, "stream": True, "max_tokens": 64}).encode(), 200),
        ("POST", "/v1/chat/completions", b"{not json", 400),
        ("GET", "/v1/models", None, 200),
    ]


def _text(rng: random.Random, size: int) -> str:
    """About ``size`` bytes of random three-letter words: the words the simulated model's tokenizer files
    know (:func:`epp.sim.tokens.write_model_files`), so that the picker's ids are the pods' own."""
    letters = string.ascii_lowercase
    return "".join(rng.choice(letters) + rng.choice(letters) + rng.choice(letters) + " " for _ in range(size // 4))


def _precise_mix(rng: random.Random, worker: int) -> Iterator[tuple[str, str, bytes | None, int]]:
    """New prompts forever: a conversation of up to 6 turns per system prompt, a unique completion between
    turns, and the mix's refusal and model list now and then (see the module docstring)."""
    session = 0
    while True:
        session += 1
        size = 20_000 if session % 10 == 0 else rng.randint(500, 12_000)
        messages: list[dict[str, str]] = [{"role": "system", "content": _text(rng, size)}]
        for turn in range(rng.randint(1, 6)):
            messages.append({"role": "user", "content": _text(rng, rng.randint(50, 3_000))})
            chat = {"model": _MODEL, "messages": messages, "max_tokens": 16, "stream": turn % 2 == 1}
            yield "POST", "/v1/chat/completions", json.dumps(chat).encode(), 200
            messages.append({"role": "assistant", "content": _text(rng, 80)})
            prompt = _text(rng, rng.randint(1_000, 20_000))
            completion = {"model": _MODEL, "prompt": prompt, "max_tokens": 16, "stream": turn % 2 == 0}
            yield "POST", "/v1/completions", json.dumps(completion).encode(), 200
        if session % 5 == 0:
            yield "POST", "/v1/chat/completions", b"{not json", 400
            yield "GET", "/v1/models", None, 200


class _Load:
    """The clients: ``workers`` loops over the mix until ``deadline``; counts answers and surprises."""

    def __init__(self, base_url: str, workers: int, deadline: float, precise: bool = False) -> None:
        self.base_url = base_url
        self.workers = workers
        self.deadline = deadline
        self.precise = precise
        self.answered = 0
        self.unexpected: dict[str, int] = {}

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._worker(session, i) for i in range(self.workers)))

    async def _worker(self, session: aiohttp.ClientSession, offset: int) -> None:
        mix = _mix()
        i = offset
        fresh = _precise_mix(random.Random(offset), offset)
        while time.monotonic() < self.deadline:
            if self.precise:
                method, path, body, expected = next(fresh)
            else:
                method, path, body, expected = mix[i % len(mix)]
                i += 1
            headers = {"content-type": "application/json"} if body is not None else {}
            try:
                async with session.request(method, self.base_url + path, data=body, headers=headers) as response:
                    await response.read()
                    status = response.status
            except (TimeoutError, aiohttp.ClientError) as error:
                key = type(error).__name__
                self.unexpected[key] = self.unexpected.get(key, 0) + 1
                continue
            self.answered += 1
            if status != expected:
                key = f"{method} {path} {status}"
                self.unexpected[key] = self.unexpected.get(key, 0) + 1


async def _sample(load: _Load, pid: int, interval: float, samples: list[Sample]) -> None:
    start = time.monotonic()
    while time.monotonic() < load.deadline:
        samples.append(_measure(pid, time.monotonic() - start, load.answered))
        await asyncio.sleep(interval)
    samples.append(_measure(pid, time.monotonic() - start, load.answered))


async def _soak(base_url: str, pid: int, args: argparse.Namespace) -> tuple[list[Sample], _Load]:
    load = _Load(base_url, args.workers, time.monotonic() + args.minutes * 60, args.precise)
    samples: list[Sample] = []
    await asyncio.gather(load.run(), _sample(load, pid, args.interval, samples))
    return samples, load


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys against xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx


def _trend(samples: list[Sample], kept: list[Sample], seconds: float, rss: Callable[[Sample], int]) -> str:
    """The slope of ``rss`` fitted from later starts, and its medians over the thirds after the warm-up: a
    slope that a step or the end of a fill made changes with a later start and shows in the thirds as one
    change, while a trend holds in each."""
    slopes = []
    for start in _LATER_STARTS:
        late = [s for s in samples if s.seconds >= start * seconds]
        if len(late) >= 3:
            slopes.append(f"{_fit([float(s.requests) for s in late], [float(rss(s)) for s in late])[0]:.2f}")
    size = len(kept) // 3
    thirds = [sorted(rss(s) for s in kept[i * size : (i + 1) * size if i < 2 else len(kept)]) for i in range(3)]
    medians = " / ".join(f"{third[len(third) // 2] / 2**20:.2f}" for third in thirds if third)
    return (
        f"fitted from {' / '.join(f'{start:.0%}' for start in _LATER_STARTS)} of the run instead: "
        f"{' / '.join(slopes)} B/request; medians of the thirds after the warm-up {medians} MiB"
    )


_LATER_STARTS = (0.4, 0.5, 0.6, 0.75)


def _plot(samples: list[Sample], kept: list[Sample], rss_fit: tuple[float, float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    xs = [s.requests for s in samples]
    top.plot(xs, [s.rss / 2**20 for s in samples], ".", label="picker RSS (ext_proc processes)")
    slope, intercept = rss_fit
    fit_x = [kept[0].requests, kept[-1].requests]
    top.plot(fit_x, [(intercept + slope * x) / 2**20 for x in fit_x], "-", label=f"fit: {slope:.2f} B/request")
    top.set_ylabel("RSS (MiB)")
    top.legend()
    top.set_title(title)
    bottom.plot(xs, [s.fds for s in samples], ".", color="tab:orange")
    bottom.set_ylabel("open fds")
    bottom.set_xlabel("requests answered")
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=4, help="requests in flight at a time")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the run left out of the fit")
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--plot", default="soak.png", help="PNG file to write ('' for none)")
    parser.add_argument("--samples", default="", help="a JSON file to write the samples to (to fit them again)")
    parser.add_argument("--picker-arg", action="append", default=[], help="an extra flag for the picker")
    parser.add_argument(
        "--picker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the picker alone (LD_PRELOAD=..., MALLOC_ARENA_MAX=1)",
    )
    parser.add_argument(
        "--envoy-graceful-close",
        action="store_true",
        help="Envoy half-closes ext_proc streams and waits for the picker's status instead of resetting them",
    )
    parser.add_argument("--tls", action="store_true", help="the picker serves TLS (--secure-serving=true) to Envoy")
    parser.add_argument(
        "--observe",
        action="store_true",
        help="Envoy observes responses (epp envoy-config --observe-responses): a second stream each",
    )
    parser.add_argument(
        "--precise",
        action="store_true",
        help="KV events, precise-prefix-cache-producer and prompts never seen (module docstring)",
    )
    parser.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=8 << 20,
        help="with --precise: the tokenizer's prefix cache (prefixCacheBytes; 0: none)",
    )
    args = parser.parse_args(argv)
    if bad := [item for item in args.picker_env if not item.partition("=")[0] or "=" not in item]:
        parser.error(f"--picker-env takes NAME=VALUE, not {bad[0]!r}")

    directory = tempfile.mkdtemp(prefix="epp-soak-")
    command = [sys.executable, "-m", "epp.sim", "--pods", str(args.pods), "--time-scale", "0.01"]
    if args.precise:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
                  "replay_endpoint": "tcp://127.0.0.1:*", "topic": f"kv@127.0.0.1@{_MODEL}"}  # fmt: skip
        command += ["--num-gpu-blocks", "2048", "--max-model-len", "32768", "--kv-events-config", json.dumps(events)]
    sim = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert sim.stdout is not None
    lines = [sim.stdout.readline().split() for _ in range(args.pods)]
    pool = [words[1].removeprefix("http://") for words in lines]
    extra = list(args.picker_arg)
    if args.precise:
        endpoints = Path(directory) / "pool.txt"  # each pod with its publisher's ports
        endpoints.write_text("".join(
            f"{words[1].removeprefix('http://')} " + " ".join(f"{k}={v.rpartition(':')[2]}" for k, _, v in
                                                             (w.partition("=") for w in words[2:])) + "\n"
            for words in lines))  # fmt: skip
        model = write_model_files(Path(directory) / "model")
        config = Path(directory) / "precise.yaml"
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/ is not a package)
        from precise_routing import precise_config

        config.write_text(precise_config(_MODEL, str(model), prefix_cache_bytes=args.prefix_cache_bytes))
        extra += ["--endpoints-file", str(endpoints), "--config-file", str(config)]
    picker_env = dict(item.partition("=")[::2] for item in args.picker_env)
    picker = PickerProcess([] if args.precise else pool, tls=args.tls, extra_args=extra, env=picker_env)
    envoy: EnvoyProcess | None = None
    try:
        picker.start()
        base = BootstrapOptions(listen_address="127.0.0.1", listen_port=0, admin_port=0, pool_endpoints=tuple(pool))
        bootstrap = render(
            replace(base, picker_port=picker.grpc_port, picker_tls=args.tls, observe_responses=args.observe)
        )
        if args.envoy_graceful_close:
            bootstrap["layered_runtime"] = {"layers": [{"name": "soak", "static_layer": {_GRACEFUL_CLOSE: True}}]}
        envoy = EnvoyProcess(bootstrap, concurrency=1)
        envoy.start()
        wait_for_picker(envoy)
        cpu_before = _cpu(picker.pid)
        samples, load = asyncio.run(_soak(f"http://127.0.0.1:{envoy.listen_port}", picker.pid, args))
        cpu = _cpu(picker.pid) - cpu_before
    finally:
        if envoy is not None:
            envoy.stop()
        picker.stop()
        sim.terminate()
        sim.wait(10)
        shutil.rmtree(directory, ignore_errors=True)

    if args.samples:
        Path(args.samples).write_text(json.dumps([vars(s) for s in samples]))
    kept = [s for s in samples if s.seconds >= args.warmup * args.minutes * 60]
    if len(kept) < 3:
        print("too few samples after the warm-up: run longer or sample more often")
        return 1
    rss_fit = _fit([float(s.requests) for s in kept], [float(s.rss) for s in kept])
    fds_fit = _fit([float(s.requests) for s in kept], [float(s.fds) for s in kept])
    grown = kept[-1].rss - kept[0].rss
    print(
        f"{args.minutes:g} min, {load.answered} requests ({load.answered / (args.minutes * 60):.0f}/s), "
        f"picker CPU {cpu * 1000 / max(1, load.answered):.2f} ms/request"
    )
    print(
        f"RSS {samples[0].rss / 2**20:.1f} MiB at start, {kept[0].rss / 2**20:.1f} after warm-up, "
        f"{samples[-1].rss / 2**20:.1f} at end ({grown / 2**20:+.2f} MiB over "
        f"{kept[-1].requests - kept[0].requests} requests after warm-up)"
    )
    print(
        f"slope after warm-up: RSS {rss_fit[0]:.2f} bytes/request, fds {fds_fit[0] * 1e6:.3f} per million requests "
        f"(fds {min(s.fds for s in samples)}..{max(s.fds for s in samples)})"
    )
    print("  " + _trend(samples, kept, args.minutes * 60, lambda s: s.rss))
    names = [name for name in kept[0].processes if all(name in s.processes for s in kept)]
    seen = {name for s in kept for name in s.processes}
    if len(seen) > 1:
        xs = [float(s.requests) for s in kept]
        print(
            "  by process (after warm-up): "
            + ", ".join(
                f"{name} {kept[0].processes[name] / 2**20:.1f} -> {kept[-1].processes[name] / 2**20:.1f} MiB, "
                f"{_fit(xs, [float(s.processes[name]) for s in kept])[0]:.2f} B/request"
                for name in names
            )
        )
        if "main" in names:
            print("  main: " + _trend(samples, kept, args.minutes * 60, lambda s: s.processes["main"]))
        if seen != set(names):  # a worker restarted (or its sample was missed): its pid is in the names
            print(f"  processes changed after the warm-up: {sorted(seen)}; fitted by process: {names}")
    if load.unexpected:
        print(f"unexpected answers: {load.unexpected}")
    if args.plot:
        _plot(samples, kept, rss_fit, args.plot, f"picker RSS over {args.minutes:g} min of mixed traffic")
        print(f"plot: {args.plot}")
    return 1 if load.unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
