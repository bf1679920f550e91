"""Decode cost of one KV-event batch: msgspec's typed decoder (what epp.prefix.kvwire uses) against msgpack
plus reading the same fields from dicts, and the cost of applying the batch to the index.

A batch like vLLM's under load: 32 BlockStored events of 16 blocks × 16 tokens each (the token ids are the
bulk), plus 16 BlockRemoved. Prints CPU time per batch (process_time), medians of 15 rounds, side by side.
Needs msgpack for the comparison (``pip install msgpack``); it is not a dependency of epp.
"""

from __future__ import annotations

import statistics
import time

import msgspec

from epp.prefix.kvindex import KVEventIndex
from epp.prefix.kvwire import decode_batch


def _payload() -> bytes:
    events = []
    for i in range(32):
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": [(i * 16 + j) * 2654435761 % 2**64 for j in range(16)],
                "parent_block_hash": None,
                "token_ids": list(range(i * 256, i * 256 + 256)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )
    events += [{"type": "BlockRemoved", "block_hashes": [k], "medium": "GPU"} for k in range(16)]
    return msgspec.msgpack.encode([time.time(), events, 0])


def _per_batch(fn, payload: bytes, n: int = 300) -> float:
    start = time.process_time()
    for _ in range(n):
        fn(payload)
    return (time.process_time() - start) / n


def main() -> None:
    try:
        import msgpack
    except ImportError:
        msgpack = None
        print("msgpack is not installed: the msgspec/msgpack comparison is left out (pip install msgpack)")

    def with_msgpack(payload: bytes) -> int:
        _ts, events, _rank = msgpack.unpackb(payload)
        total = 0
        for e in events:
            kind = e["type"]
            if kind == "BlockStored":
                total += len(e["block_hashes"]) + len(e["token_ids"]) + e["block_size"]
                e.get("parent_block_hash"), e.get("medium"), e.get("extra_keys")
            elif kind == "BlockRemoved":
                total += len(e["block_hashes"])
        return total

    payload = _payload()
    rows: dict[str, list[float]] = {"msgspec typed (kvwire)": [], "apply to index": []}
    if msgpack is not None:
        rows["msgpack + dict reads"] = []
    batch = decode_batch(payload)
    for _ in range(15):
        rows["msgspec typed (kvwire)"].append(_per_batch(decode_batch, payload))
        if msgpack is not None:
            rows["msgpack + dict reads"].append(_per_batch(with_msgpack, payload))
        index = KVEventIndex()
        start = time.process_time()
        for r in range(100):
            index.apply(f"pod-{r}", batch.events)  # a fresh pod each time: every block is new to it
        rows["apply to index"].append((time.process_time() - start) / 100)
    print(f"batch: {len(payload)} bytes, {len(batch.events)} events, 512 blocks stored")
    for name, values in rows.items():
        print(f"{name:26s} median {statistics.median(values) * 1e6:8.1f} µs CPU per batch")
    apply = statistics.median(rows["apply to index"])
    print(f"apply per block: {apply / 512 * 1e6:.2f} µs")
    if msgpack is not None:
        ratio = statistics.median(rows["msgpack + dict reads"]) / statistics.median(rows["msgspec typed (kvwire)"])
        print(f"msgpack / msgspec: {ratio:.2f}x")


if __name__ == "__main__":
    main()
