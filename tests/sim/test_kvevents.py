"""The simulator's publisher writes vLLM 0.32's frames, read here with plain ZMQ and msgpack decoding."""

import time

import msgspec
import zmq

from epp.sim.kvevents import KVEventPublisher
from epp.testing.envoy import free_port_run


def _subscribe(endpoint):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(endpoint)
    return sock


def _first_message(pub, sock):
    for _ in range(200):
        pub.cleared()
        pub.flush()
        if sock.poll(20):
            return sock.recv_multipart()
    raise AssertionError("nothing received")


def test_a_data_parallel_rank_publishes_on_the_port_plus_its_rank_as_vllm_does():
    port = free_port_run(13)  # rank 2 binds the port + 2 and its replay socket the port + 12
    bound = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@x@m", data_parallel_rank=2, bind=True,
                             replay_endpoint=f"tcp://127.0.0.1:{port + 10}")  # fmt: skip
    connecting = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@x@m", data_parallel_rank=3)
    try:
        assert bound.endpoint == f"tcp://127.0.0.1:{port + 2}"
        assert bound.replay_endpoint == f"tcp://127.0.0.1:{port + 12}"
        assert connecting.endpoint == f"tcp://127.0.0.1:{port + 3}"
    finally:
        bound.close()
        connecting.close()


def test_frames_are_topic_seq_and_a_msgpack_batch_of_maps():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv@127.0.0.1:8000@m", data_parallel_rank=1)
    sock = _subscribe(pub.endpoint)
    try:
        _first_message(pub, sock)
        pub.stored([7], None, list(range(16)), 16)
        pub.removed([7])
        seq = pub.flush()
        while True:
            topic, seq_frame, payload = sock.recv_multipart()
            if int.from_bytes(seq_frame, "big") == seq:
                break
        assert topic == b"kv@127.0.0.1:8000@m" and len(seq_frame) == 8
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert abs(ts - time.time()) < 5 and rank == 1
        # What vLLM 0.32's own msgspec classes encode (checked with vllm.distributed.kv_events in the
        # tier's venv): every field without a default, extra_keys one None per block, group_idx 0.
        assert events[0] == {
            "type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": list(range(16)),
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None],
            "group_idx": 0,
        }
        assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                   "lora_id", "medium", "lora_name", "extra_keys", "group_idx"]
        assert events[1] == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    finally:
        sock.close(0)
        pub.close()


def test_replay_answers_buffered_batches_then_the_end_marker_and_restart_resets_seq():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv@x", replay_endpoint="tcp://127.0.0.1:*")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 3000)
    try:
        for _ in range(3):
            pub.cleared()
            pub.flush()
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(r[2], "big") for r in replies[:2]] == [1, 2]
        assert replies[0][1] == b"kv@x"
        assert replies[2] == [b"", b"", b"\xff" * 8, b""]
        pub.restart()
        pub.cleared()
        assert pub.flush() == 0
    finally:
        dealer.close(0)
        pub.close()
