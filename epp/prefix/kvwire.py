"""The KV-cache event wire format of vLLM (and SGLang): ZMQ frames decoded into typed batches.

A publisher sends multipart messages ``[topic, seq, payload]``: ``seq`` is an 8-byte big-endian unsigned
counter per publisher process (from 0, back to 0 when the process restarts), ``payload`` is msgpack
``[ts, events, data_parallel_rank]``. vLLM 0.32+ sends each event as a map tagged by ``"type"`` with
defaults omitted; older releases sent arrays with the tag first. Both are accepted: a batch is decoded
as maps first and, only if that fails, as arrays (so the common case pays for one typed decode, in C,
with msgspec; ``bench/kvevents_decode.py`` measured it against msgpack + dict access). Unknown fields
and unknown trailing array elements are ignored, so a newer engine's additions do not break decoding;
an unknown event type or a malformed batch is a :class:`WireError` naming what was wrong. The structs
are not tracked by the garbage collector (``gc=False``, as vLLM's own): they hold no cycles, and at
thousands of batches a second the collector's passes over them were pauses on the loop.

Hashes are kept as the engine sent them (vLLM: uint64, SGLang: signed int64, some releases: bytes); they
only identify a block *within one pod's stream* (``BlockRemoved`` and ``parent_block_hash`` refer to
them). The index keys blocks by its own hash of the token ids (see :mod:`epp.prefix.kvindex`).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "WireError",
    "decode_batch",
    "decode_seq",
    "rank_endpoint",
]

EngineHash = int | bytes


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where data-parallel rank ``rank`` of a server publishes (or answers replays) when rank 0 is at
    ``endpoint``: vLLM's ``offset_endpoint_port`` rule, a tcp port + rank (port 0 and ``*`` stay, being
    chosen at bind time), ``inproc://name`` -> ``inproc://name_dp<rank>``, anything else unchanged."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and sep and port.isdigit() and int(port) != 0:
        return f"{head}:{int(port) + rank}"
    return endpoint


class WireError(ValueError):
    """A frame that is not a KV-event message (the message says what was wrong)."""


class BlockStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 16
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (vLLM: a tuple of salt / adapter / multimodal ids, or None).
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


# The old array form: the same fields in the same order, the tag first.
class _ArrayStored(BlockStored, array_like=True, tag="BlockStored", gc=False):
    pass


class _ArrayRemoved(BlockRemoved, array_like=True, tag="BlockRemoved", gc=False):
    pass


class _ArrayCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]
    data_parallel_rank: int | None = None


_MAP_DECODER = msgspec.msgpack.Decoder(EventBatch)
_ARRAY_DECODER = msgspec.msgpack.Decoder(_ArrayBatch)


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence number of a message."""
    if len(frame) != 8:
        raise WireError(f"sequence frame is {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def decode_batch(payload: bytes) -> EventBatch:
    """A payload's batch, events as maps (vLLM ≥ 0.11, SGLang) or as arrays (older vLLM)."""
    try:
        return _MAP_DECODER.decode(payload)
    except msgspec.DecodeError as map_error:
        try:
            old = _ARRAY_DECODER.decode(payload)
        except msgspec.DecodeError:
            raise WireError(f"not a KV-event batch: {map_error}") from None
    # The array-form classes are subclasses of the map-form ones: callers see one set of types.
    return EventBatch(ts=old.ts, events=list(old.events), data_parallel_rank=old.data_parallel_rank)
