"""Event-to-index lag of the KV-event subscriber, and what an event storm does to the request path.

Two processes on 127.0.0.1, as in production: a publisher (the simulator's ``KVEventPublisher``, vLLM
0.32's wire format; this script run with ``--publish``) binds a PUB socket, and this process runs the
subscriber on an asyncio (uvloop) loop, in connect mode, into a ``KVEventIndex``. Alongside it, a
*request probe* stands for the picker's request path on the same loop: every 2 ms it looks an
8k-token prompt up (``chain_keys`` + ``match``, what the precise producer does per request) and
records how late it started (the loop was busy) and how long it took.

Phases, each ``--seconds`` long, alternated ``--rounds`` times, medians of the per-phase figures:

* ``idle``: no events (the probe's floor);
* ``10k/s``: batches of 10 ``BlockStored`` events (one 16-token block each, chained) every ms;
* ``storm``: every 10 ms a batch of 32 events of 16 blocks (512 blocks, ~33 KB, the shape of a busy
  vLLM step) and, once 50k blocks are held, the removal of as many (tail first): 51k blocks stored
  and 51k removed a second, five times the 10k/s phase in blocks. (A publisher sending as fast as it
  can was tried first: on two cores it starves the subscriber's process of CPU, and what the probe
  then measures is the operating system's scheduling, not the loop.)

Lag is the time from a batch's publisher timestamp to its application (same clock). Printed: lag
P50/P99/max, events/s received, the subscriber process's CPU seconds per second (all its threads,
ZMQ's I/O thread included; the probe's own lookups subtracted) and per event above the idle
phase's, and the probe's start delay and total P50/P99. Run: ``python bench/kvevents_lag.py``
(about a minute).

Results (2 shared cores, other sessions' benches running): quoted in ``epp/prefix/kvsubscriber.py``'s
docstring; at 10k events/s, lag P99 5.84 ms at load average ~10 and 0.83 ms at ~1.5, against
707.8 ms for the first subscriber (one loop wake-up per message, publisher in the same process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import deque

import numpy as np

from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvsubscriber import KVEventSubscriber
from epp.testing.envoy import free_port

POD = "127.0.0.1:8000"
_PROBE_EVERY_S = 0.002
_PROMPT_TOKENS = 8192


def _publish(args: argparse.Namespace) -> None:
    from epp.sim.kvevents import KVEventPublisher

    pub = KVEventPublisher(args.publish, f"kv@{POD}@m", bind=True)
    try:
        # Until the start time, probes only (a SUB sees nothing sent before its subscription arrived).
        while time.time() < args.start_at:
            pub.cleared()
            pub.flush()
            time.sleep(0.02)
        end = args.start_at + args.seconds
        h = 1
        if args.mode == "rate":
            next_at = time.perf_counter()
            while time.time() < end:
                for _ in range(args.per_batch):
                    pub.stored([h], h - 1 if h > 1 else None, list(range(h * 16, h * 16 + 16)), 16)
                    h += 1
                pub.flush()
                next_at += 0.001
                time.sleep(max(0.0, next_at - time.perf_counter()))
        else:  # storm: every 10 ms, 32 events of 16 blocks, and as many evicted once 50k are held
            live: deque[list[int]] = deque()
            next_at = time.perf_counter()
            while time.time() < end:
                for _ in range(32):
                    tokens = list(range(h * 16, h * 16 + 256))
                    hashes = list(range(h, h + 16))
                    pub.stored(hashes, None, tokens, 16)
                    live.append(hashes)
                    h += 16
                while len(live) * 16 > 50_000:
                    pub.removed(list(reversed(live.popleft())))  # tail first, as vLLM evicts
                pub.flush()
                next_at += 0.01
                time.sleep(max(0.0, next_at - time.perf_counter()))
        print(json.dumps({"batches": pub.seq}), flush=True)
    finally:
        time.sleep(0.2)
        pub.close()


async def _phase(mode: str, seconds: float) -> dict[str, float]:
    port = free_port()
    start_at = time.time() + 1.0
    publisher = None
    if mode != "idle":
        publisher = subprocess.Popen(
            [sys.executable, __file__, "--publish", f"tcp://127.0.0.1:{port}", "--start-at", str(start_at),
             "--seconds", str(seconds), "--mode", "rate" if mode == "10k/s" else "storm"],
            stdout=subprocess.PIPE, text=True,
        )
    sub = KVEventSubscriber(KVEventIndex(max_blocks_per_pod=200_000))
    lags: list[float] = []

    def on_lag(lag: float) -> None:
        if time.time() - lag >= start_at:  # publisher's timestamp inside the measured window
            lags.append(lag)

    sub._on_lag = on_lag
    sub.follow(POD, f"tcp://127.0.0.1:{port}")
    prompt = np.random.default_rng(1).integers(0, 50_000, size=_PROMPT_TOKENS).astype(np.uint32)
    delays: list[float] = []
    totals: list[float] = []
    probe_cpu = 0.0
    loop = asyncio.get_running_loop()
    while time.time() < start_at:
        await asyncio.sleep(0.01)
    events0 = sub.stats.events
    cpu0 = time.process_time()
    end = start_at + seconds
    due = time.perf_counter()
    while time.time() < end:
        due += _PROBE_EVERY_S
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        began = time.perf_counter()
        c0 = time.process_time()
        sub.index.match(chain_keys(prompt, 16))
        probe_cpu += time.process_time() - c0
        delays.append(began - due)
        totals.append(time.perf_counter() - due)
    # Let the subscriber catch up (storm) before counting.
    deadline = time.time() + 10.0
    if publisher is not None:
        out, _ = await loop.run_in_executor(None, publisher.communicate)
        sent = json.loads(out.strip().splitlines()[-1])["batches"]
        while (sub.last_seq(POD) or 0) < sent - 1 and time.time() < deadline:
            await asyncio.sleep(0.01)
    cpu = time.process_time() - cpu0 - probe_cpu
    events = sub.stats.events - events0
    await sub.close()

    def q(values: list[float], p: float) -> float:
        return float(np.percentile(values, p)) * 1e3 if values else float("nan")

    return {
        "lag_p50_ms": q(lags, 50), "lag_p99_ms": q(lags, 99), "lag_max_ms": max(lags, default=0.0) * 1e3,
        "events_per_s": events / seconds, "cpu_per_s": cpu / seconds,
        "gaps": float(sub.stats.gaps),
        "probe_delay_p50_ms": q(delays, 50), "probe_delay_p99_ms": q(delays, 99),
        "probe_total_p50_ms": q(totals, 50), "probe_total_p99_ms": q(totals, 99),
    }


async def _main(args: argparse.Namespace) -> None:
    phases = ("idle", "10k/s", "storm")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in phases}
    for r in range(args.rounds):
        for phase in phases:
            result = await _phase(phase, args.seconds)
            runs[phase].append(result)
            print(f"round {r + 1} {phase:6s} " + " ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    print(f"\nmedians of {args.rounds} rounds of {args.seconds:.0f} s:")
    head = f"{'phase':7s} {'events/s':>9s} {'lag P50':>8s} {'P99':>8s} {'max':>8s} {'CPU/s':>6s} {'/event':>8s} " \
           f"{'probe delay P50':>15s} {'P99':>7s} {'probe total P50':>15s} {'P99':>7s}"
    print(head)
    idle_cpu = statistics.median(r["cpu_per_s"] for r in runs["idle"])
    for phase in phases:
        m = {k: statistics.median(r[k] for r in runs[phase]) for k in runs[phase][0]}
        per_event = (m["cpu_per_s"] - idle_cpu) / m["events_per_s"] * 1e6 if m["events_per_s"] else float("nan")
        print(f"{phase:7s} {m['events_per_s']:9.0f} {m['lag_p50_ms']:6.2f}ms {m['lag_p99_ms']:6.2f}ms "
              f"{m['lag_max_ms']:6.1f}ms {m['cpu_per_s']:6.3f} {per_event:6.2f}µs {m['probe_delay_p50_ms']:13.3f}ms "
              f"{m['probe_delay_p99_ms']:5.2f}ms {m['probe_total_p50_ms']:13.3f}ms {m['probe_total_p99_ms']:5.2f}ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-batch", type=int, default=10, help="events per batch at 1 batch/ms")
    parser.add_argument("--publish", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="rate", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish:
        _publish(args)
        return
    try:
        import uvloop

        uvloop.run(_main(args))
    except ImportError:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
