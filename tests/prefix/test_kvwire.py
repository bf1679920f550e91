import msgspec
import pytest

from epp.prefix.kvwire import AllBlocksCleared, BlockRemoved, BlockStored, WireError, decode_batch, decode_seq


def test_map_events_with_unknown_fields_decode():
    payload = msgspec.msgpack.encode(
        [
            1.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [2**64 - 1],
                    "parent_block_hash": None,
                    "token_ids": list(range(16)),
                    "block_size": 16,
                    "medium": "GPU",
                    "kv_cache_spec_kind": "full",  # a field this decoder does not know
                    "extra_keys": [["salt"]],
                },
                {"type": "BlockRemoved", "block_hashes": [-3], "medium": "CPU"},
                {"type": "AllBlocksCleared"},
            ],
            2,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 2
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == [2**64 - 1]
    assert stored.parent_block_hash is None and stored.token_ids == list(range(16))
    assert stored.extra_keys == [["salt"]]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [-3] and removed.medium == "CPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_old_array_events_decode_to_the_same_types():
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                ["BlockStored", [5, 6], 4, list(range(32)), 16, None, "GPU"],
                ["BlockRemoved", [5], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.parent_block_hash == 4 and stored.block_hashes == [5, 6]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [5]
    assert isinstance(cleared, AllBlocksCleared)
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]),
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0]),
    ],
)
def test_bad_batches_are_wire_errors(payload):
    with pytest.raises(WireError, match="not a KV-event batch"):
        decode_batch(payload)


def test_seq_is_eight_bytes_big_endian():
    assert decode_seq((281).to_bytes(8, "big")) == 281
    with pytest.raises(WireError, match="4 bytes"):
        decode_seq(b"\0\0\0\1")
