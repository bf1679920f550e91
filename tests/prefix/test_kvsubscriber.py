"""The subscriber against the simulator's publisher, over real ZMQ sockets on 127.0.0.1."""

import asyncio
import logging

import pytest

from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvsubscriber import KVEventSubscriber, topic_address
from epp.sim.kvevents import KVEventPublisher
from epp.testing.envoy import free_port_run

BS = 4
POD = "127.0.0.1:8000"
_NOTHING = 2**63  # an engine hash no test stores


async def _until(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def _store_chain(pub, tokens, first_hash=1):
    """Store every whole block of tokens as one chain; engine hashes first_hash, first_hash + 1, ..."""
    n = len(tokens) // BS
    pub.stored(list(range(first_hash, first_hash + n)), None, tokens[: n * BS], BS)


async def _connected(pub, sub, replay=False, pod=POD):
    sub.follow(pod, pub.endpoint, pub.replay_endpoint if replay else None)
    # A SUB socket sees nothing sent before its subscription reached the publisher: probe until it has
    # (with a replay endpoint the probes it missed are replayed: wait for that too).
    while sub.last_seq(pod) is None or sub.last_seq(pod) != pub.seq - 1:
        pub.removed([_NOTHING])  # a harmless probe
        pub.flush()
        await asyncio.sleep(0.02)


@pytest.fixture
def pub():
    p = KVEventPublisher("tcp://127.0.0.1:*", f"kv@{POD}@m", replay_endpoint="tcp://127.0.0.1:*")
    yield p
    p.close()


@pytest.fixture
async def sub():
    s = KVEventSubscriber(KVEventIndex())
    yield s
    await s.close()


async def test_stored_blocks_become_matches(pub, sub):
    await _connected(pub, sub)
    tokens = list(range(40))
    _store_chain(pub, tokens)
    pub.flush()
    keys = chain_keys(tokens, BS)
    await _until(lambda: sub.index.match(keys).get(POD, (0, 0))[0] == 10)
    pub.removed([10, 9])  # tail first, as vLLM evicts
    pub.flush()
    await _until(lambda: sub.index.match(keys)[POD][0] == 8)


async def test_a_late_subscriber_replays_the_stream_from_its_start(pub, sub):
    tokens = list(range(16))
    _store_chain(pub, tokens)
    pub.flush()  # seq 0, sent before anyone listened
    await _connected(pub, sub, replay=True)
    assert sub.stats.replays == 1 and sub.stats.gaps == 0
    assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 4


async def test_a_pod_that_published_before_the_subscriber_joined_and_then_stayed_quiet_is_replayed(pub, sub):
    """No later message reveals the late start: the connection itself asks for the publisher's buffer."""
    tokens = list(range(16))
    _store_chain(pub, tokens)
    pub.flush()  # seq 0 and 1, sent before anyone listened; nothing after
    pub.removed([_NOTHING])
    pub.flush()
    sub.follow(POD, pub.endpoint, pub.replay_endpoint)
    await _until(lambda: sub.last_seq(POD) == 1)
    assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 4
    assert sub.stats.replays == 1 and sub.stats.gaps == 0 and sub.stats.resets == 0


async def test_batches_delivered_live_during_the_connections_replay_are_applied_once(pub, sub):
    """Batches that arrive live while the catch-up replay is under way, and are in its answer too, are
    the same batches: skipped after the replay, not taken for a publisher restart (which clears the pod)."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub.follow(POD, pub.endpoint, f"tcp://127.0.0.1:{port}")
        client, _, start = await asyncio.wait_for(router.recv_multipart(), 5)  # the connection's catch-up
        assert int.from_bytes(start, "big") == 0
        tokens = list(range(16))
        # Live, while the replay is held here: the first batches may miss the subscription; probe until
        # the subscriber has held one back (the replay endpoint answers only after that).
        _store_chain(pub, tokens)
        pub.flush()
        while True:
            pub.removed([_NOTHING])
            pub.flush()
            await asyncio.sleep(0.02)
            if sub._streams[POD].held_back:
                break
        for seq, payload in list(pub._buffer):
            await router.send_multipart([client, b"", pub.topic, seq.to_bytes(8, "big"), payload])
        await router.send_multipart([client, b"", b"", (2**64 - 1).to_bytes(8, "big"), b""])
        await _until(lambda: sub.last_seq(POD) == pub.seq - 1)
        assert sub.stats.resets == 0 and sub.stats.gaps == 0 and sub.stats.replays == 1
        assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 4
    finally:
        router.close(0)
        ctx.term()


async def test_gap_is_replayed_from_the_replay_endpoint(pub, sub):
    await _connected(pub, sub, replay=True)
    replays = sub.stats.replays
    tokens = list(range(16))
    _store_chain(pub, tokens)
    pub.flush(send=False)  # lost on the way: only the replay endpoint has it
    pub.removed([999])  # unrelated, makes the hole visible
    pub.flush()
    await _until(lambda: sub.stats.replays == replays + 1)
    assert sub.stats.gaps == 1
    assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 4 and sub.index.known(POD)


async def test_batches_arriving_during_a_replay_are_applied_after_it_in_order(pub, sub):
    await _connected(pub, sub, replay=True)
    tokens = list(range(24))
    pub.stored([1, 2], None, tokens[:8], BS)
    pub.flush(send=False)  # lost
    pub.removed([999])
    pub.flush()  # reveals the hole
    pub.stored([3, 4], 2, tokens[8:16], BS)  # needs the lost batch's blocks as parents
    pub.flush()
    pub.stored([5, 6], 4, tokens[16:24], BS)
    pub.flush()
    await _until(lambda: sub.last_seq(POD) == pub.seq - 1)
    assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 6


async def test_gap_without_replay_drops_the_pods_blocks(pub, sub):
    await _connected(pub, sub, replay=False)
    old = list(range(16))
    _store_chain(pub, old)
    pub.flush()
    await _until(lambda: POD in sub.index.match(chain_keys(old, BS)))
    pub.stored([50], None, [7, 7, 7, 7], BS)
    pub.flush(send=False)
    new = list(range(100, 108))
    _store_chain(pub, new, first_hash=60)
    pub.flush()
    await _until(lambda: sub.stats.gaps == 1)
    # What was held before the hole is forgotten; what came after it is known.
    assert sub.index.match(chain_keys(old, BS)) == {}
    assert sub.index.match(chain_keys(new, BS))[POD][0] == 2 and sub.stats.replays == 0


async def test_publisher_restart_and_clear_empty_the_pod(pub, sub):
    await _connected(pub, sub)
    tokens = list(range(16))
    _store_chain(pub, tokens)
    pub.flush()
    await _until(lambda: POD in sub.index.match(chain_keys(tokens, BS)))
    pub.restart()  # seq back to 0
    pub.removed([12345])
    pub.flush()
    await _until(lambda: sub.stats.resets == 1)
    assert sub.index.match(chain_keys(tokens, BS)) == {}
    _store_chain(pub, tokens)
    pub.flush()
    await _until(lambda: POD in sub.index.match(chain_keys(tokens, BS)))
    pub.cleared()
    pub.flush()
    await _until(lambda: sub.index.stats().blocks == 0)


async def test_eviction_storm_two_subscribers_end_identical(pub):
    subs = [KVEventSubscriber(KVEventIndex(max_blocks_per_pod=200)) for _ in range(2)]
    try:
        for s in subs:
            await _connected(pub, s)
        hashes = 1
        live: list[int] = []
        for round_ in range(50):
            tokens = [round_ * 1000 + i for i in range(64)]
            _store_chain(pub, tokens, first_hash=hashes)
            live.extend(range(hashes, hashes + 16))
            hashes += 16
            if len(live) > 120:
                evict, live = live[:40], live[40:]
                pub.removed(list(reversed(evict)))
            pub.flush()
        total = pub.seq
        await _until(lambda: all(s.last_seq(POD) == total - 1 for s in subs))
        a, b = (s.index.blocks_of(POD) for s in subs)
        assert a == b and len(a) == len(live)
        assert subs[0].index.engine_hashes(POD) == set(live)
    finally:
        for s in subs:
            await s.close()


async def test_a_backlog_is_drained_a_slice_per_loop_turn(pub):
    """A burst larger than the budget is applied over several loop turns, not in one."""
    sub = KVEventSubscriber(KVEventIndex(), budget_s=0.0005)
    turns = 0
    stop = False

    async def ticker() -> None:
        nonlocal turns
        while not stop:
            await asyncio.sleep(0)
            turns += 1

    try:
        await _connected(pub, sub)
        for i in range(300):
            pub.stored(list(range(i * 64 + 1, i * 64 + 65)), None, list(range(64 * BS)), BS)
            pub.flush()
        task = asyncio.create_task(ticker())
        await _until(lambda: sub.last_seq(POD) == pub.seq - 1)
        stop = True
        await task
        assert turns > 5  # other tasks ran while the backlog was applied
    finally:
        await sub.close()


async def test_a_topic_outside_the_filter_is_dropped_with_a_warning_and_counted(caplog):
    pub = KVEventPublisher("tcp://127.0.0.1:*", "")  # vLLM's default topic: ""
    rejected: list[str] = []
    sub = KVEventSubscriber(KVEventIndex(), on_reject=rejected.append)
    try:
        sub.follow(POD, pub.endpoint)
        with caplog.at_level(logging.WARNING, logger="epp.prefix.kvsubscriber"):
            await _until(lambda: (pub.cleared(), pub.flush(), sub.stats.rejected["topic"] > 2)[-1])
        assert sub.stats.batches == 0 and set(rejected) == {"topic"}
        warnings = [r.getMessage() for r in caplog.records if "does not start with the filter" in r.getMessage()]
        assert len(warnings) == 1 and POD in warnings[0]  # once, naming the pod and the fix
    finally:
        pub.close()
        await sub.close()


async def test_a_topic_naming_another_pod_is_applied_to_the_sockets_pod_and_flagged():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv@10.1.1.1:8000@m")  # a copied config
    sub = KVEventSubscriber(KVEventIndex())
    try:
        await _connected(pub, sub)
        assert sub.stats.rejected["identity"] > 0 and sub.index.pods() == [POD]
    finally:
        pub.close()
        await sub.close()


async def test_an_llm_d_topic_with_the_ip_alone_is_accepted():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv@127.0.0.1@Qwen/Qwen3-0.6B")
    sub = KVEventSubscriber(KVEventIndex())
    try:
        await _connected(pub, sub)
        assert sub.stats.rejected_total == 0
    finally:
        pub.close()
        await sub.close()


async def test_bound_socket_accepts_only_pool_pods_from_their_address():
    sub = KVEventSubscriber(KVEventIndex(), bind="tcp://127.0.0.1:*")
    sub.start()
    good = KVEventPublisher(sub.bound_endpoint, f"kv@{POD}@m")
    stranger = KVEventPublisher(sub.bound_endpoint, "kv@10.9.9.9:8000@m")
    impostor = KVEventPublisher(sub.bound_endpoint, "kv@127.0.0.2:8000@m")  # a pool pod's name, our address
    try:
        sub.allow(POD)
        sub.allow("127.0.0.2:8000")
        tokens = list(range(8))
        while POD not in sub.index.match(chain_keys(tokens, BS)) or not sub.stats.rejected["peer"]:
            _store_chain(good, tokens)
            good.flush()
            for other in (stranger, impostor):
                other.cleared()
                other.flush()
            await asyncio.sleep(0.02)
        await _until(lambda: sub.stats.rejected["unknown_pod"] > 0)
        assert sub.index.pods() == [POD]
    finally:
        for p in (good, stranger, impostor):
            p.close()
        await sub.close()


async def test_bound_socket_replays_a_quiet_late_start_and_gaps_from_the_pods_replay_endpoint():
    """Bind mode: the pod published before the picker bound (nobody subscribed: dropped) and then stayed
    quiet; its connection asks its replay endpoint for what it holds. A later hole is replayed too."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"kv@{POD}@m", replay_endpoint="tcp://127.0.0.1:*")
    sub = KVEventSubscriber(KVEventIndex(), bind=f"tcp://127.0.0.1:{port}")
    try:
        tokens = list(range(16))
        _store_chain(pub, tokens)
        pub.flush()  # seq 0: no subscriber yet
        sub.start()
        sub.allow(POD, replay_endpoint=pub.replay_endpoint)
        await _until(lambda: sub.last_seq(POD) == 0)
        assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 4 and sub.stats.replays == 1
        more = list(range(100, 108))
        _store_chain(pub, more, first_hash=50)
        pub.flush(send=False)  # lost on the way
        pub.removed([_NOTHING])
        pub.flush()
        await _until(lambda: sub.last_seq(POD) == 2)
        assert sub.stats.gaps == 1 and sub.stats.replays == 2
        assert sub.index.match(chain_keys(more, BS))[POD][0] == 2
    finally:
        pub.close()
        await sub.close()


async def test_bound_socket_resolves_ip_only_topics_by_rank_when_the_pool_has_one_endpoint_per_rank():
    """vLLM's rank r connects to the configured port + r: the socket binds that port too, once the pool
    has an endpoint per rank; an ip-only topic then names the rank's endpoint, by port order."""
    sub = KVEventSubscriber(KVEventIndex(), bind=f"tcp://127.0.0.1:{free_port_run(2)}")  # and the port + 1
    sub.start()
    ranks = [KVEventPublisher(sub.bound_endpoint, "kv@127.0.0.1@m", data_parallel_rank=r) for r in range(2)]
    try:
        assert sub.rank_endpoints == {}
        sub.allow("127.0.0.1:8001")  # rank 1's server (by port order)
        sub.allow("127.0.0.1:8000")
        port = int(sub.bound_endpoint.rsplit(":", 1)[1])
        assert sub.rank_endpoints == {1: f"tcp://127.0.0.1:{port + 1}"} == {1: ranks[1].endpoint}
        for r, p in enumerate(ranks):
            tokens = [r] * 8
            while f"127.0.0.1:800{r}" not in sub.index.match(chain_keys(tokens, BS)):
                _store_chain(p, tokens)
                p.flush()
                await asyncio.sleep(0.02)
        assert sorted(sub.index.pods()) == ["127.0.0.1:8000", "127.0.0.1:8001"]
    finally:
        for p in ranks:
            p.close()
        await sub.close()


async def test_a_rank_port_already_taken_is_logged_and_rank_0_still_arrives(caplog):
    import socket

    port = free_port_run(2)  # (a free port whose next was free too: a probe's port + 1 could be taken)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        sub = KVEventSubscriber(KVEventIndex(), bind=f"tcp://127.0.0.1:{port}")
        sub.start()
        pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@127.0.0.1@m")
        try:
            sub.allow("127.0.0.1:8000")
            sub.allow("127.0.0.1:8001")
            assert sub.rank_endpoints == {1: None}
            assert f"cannot bind tcp://127.0.0.1:{port + 1} for data-parallel rank 1" in caplog.text
            tokens = list(range(8))
            while "127.0.0.1:8000" not in sub.index.match(chain_keys(tokens, BS)):
                _store_chain(pub, tokens)
                pub.flush()
                await asyncio.sleep(0.02)
        finally:
            pub.close()
            await sub.close()


async def test_old_array_events_are_followed():
    pub = KVEventPublisher("tcp://127.0.0.1:*", f"kv@{POD}@m", array_events=True)
    sub = KVEventSubscriber(KVEventIndex())
    try:
        await _connected(pub, sub)
        tokens = list(range(8))
        _store_chain(pub, tokens)
        pub.flush()
        await _until(lambda: POD in sub.index.match(chain_keys(tokens, BS)))
    finally:
        pub.close()
        await sub.close()


async def test_unfollow_drops_the_pod(pub, sub):
    await _connected(pub, sub)
    _store_chain(pub, list(range(8)))
    pub.flush()
    await _until(lambda: sub.index.stats().blocks == 2)
    sub.unfollow(POD)
    assert sub.index.pods() == [] and sub.last_seq(POD) is None


@pytest.mark.parametrize(
    ("topic", "address"),
    [("kv@10.0.0.1:8000@m", "10.0.0.1:8000"), ("kv@10.0.0.1@Qwen/Qwen3", "10.0.0.1"),
     ("kv@[fd00::1]:8000@m", "[fd00::1]:8000"), ("", ""), ("kv", "")],
)
def test_topic_address(topic, address):
    assert topic_address(topic) == address


async def test_bound_socket_resolves_a_topic_naming_the_pod_by_its_name():
    sub = KVEventSubscriber(KVEventIndex(), bind="tcp://127.0.0.1:*")
    sub.start()
    pub = KVEventPublisher(sub.bound_endpoint, "kv@vllm-7f9c-abcde@Qwen/Qwen3-8B")  # kv@$(POD_NAME)@model
    try:
        sub.allow(POD, ("vllm-7f9c-abcde-rank-0", "vllm-7f9c-abcde"))
        tokens = list(range(8))
        while POD not in sub.index.match(chain_keys(tokens, BS)):
            _store_chain(pub, tokens)
            pub.flush()
            await asyncio.sleep(0.02)
        assert sub.stats.rejected_total == 0
    finally:
        pub.close()
        await sub.close()


async def test_a_topic_naming_the_pod_by_name_is_not_flagged_in_connect_mode():
    pub = KVEventPublisher("tcp://127.0.0.1:*", "kv@vllm-7f9c-abcde@m")
    sub = KVEventSubscriber(KVEventIndex())
    try:
        await _connected(pub, sub)
        assert sub.stats.rejected_total == 0
    finally:
        pub.close()
        await sub.close()
