"""Event-to-index lag of the KV-event subscriber at a steady event rate, over ZMQ on 127.0.0.1.

The simulator's publisher (in a thread) sends batches of 10 events (each a BlockStored of one 16-token
block, chained) every millisecond: 10k events/s for ``--seconds`` (default 3). The subscriber applies them
to a KVEventIndex on the asyncio loop; lag is the time from the batch's publisher timestamp to its
application (same clock). Prints the lag's P50/P99/max and the subscriber process's CPU per event.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from epp.prefix.kvindex import KVEventIndex
from epp.prefix.kvsubscriber import KVEventSubscriber
from epp.sim.kvevents import KVEventPublisher

POD = "127.0.0.1:8000"


def _publish(pub: KVEventPublisher, seconds: float, per_batch: int, stop: threading.Event) -> None:
    next_at = time.perf_counter()
    end = next_at + seconds
    h = 1
    while next_at < end and not stop.is_set():
        for _ in range(per_batch):
            pub.stored([h], h - 1 if h > 1 else None, list(range(h * 16, h * 16 + 16)), 16)
            h += 1
        pub.flush()
        next_at += 0.001
        time.sleep(max(0.0, next_at - time.perf_counter()))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--events-per-ms", type=int, default=10)
    args = parser.parse_args()
    pub = KVEventPublisher("tcp://127.0.0.1:*", f"kv@{POD}@m", bind=True)
    sub = KVEventSubscriber(KVEventIndex(max_blocks_per_pod=100_000))
    sub.follow(POD, pub.endpoint)
    while sub.stats.batches == 0:  # until the subscription is in place
        pub.cleared()
        pub.flush()
        await asyncio.sleep(0.02)
    sub.stats.lags.clear()
    events0, cpu0 = sub.stats.events, time.process_time()
    stop = threading.Event()
    thread = threading.Thread(target=_publish, args=(pub, args.seconds, args.events_per_ms, stop))
    thread.start()
    lags: list[float] = []
    while thread.is_alive():
        await asyncio.sleep(0.05)
        lags.extend(sub.stats.lags)
        sub.stats.lags.clear()
    await asyncio.sleep(0.2)
    lags.extend(sub.stats.lags)
    cpu = time.process_time() - cpu0  # publisher thread included: an upper bound for the subscriber
    events = sub.stats.events - events0
    q = statistics.quantiles(lags, n=100)
    rate = events / args.seconds
    print(f"events {events} in {args.seconds:.0f} s ({rate:.0f}/s), batches {len(lags)}, gaps {sub.stats.gaps}")
    print(f"lag ms: P50 {q[49] * 1e3:.2f}  P99 {q[98] * 1e3:.2f}  max {max(lags) * 1e3:.2f}")
    print(f"process CPU per event (publisher + subscriber): {cpu / max(1, events) * 1e6:.1f} µs")
    await sub.close()
    pub.close()


if __name__ == "__main__":
    asyncio.run(main())
