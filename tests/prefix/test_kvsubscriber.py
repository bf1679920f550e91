"""The subscriber against the simulator's publisher, over real ZMQ sockets on 127.0.0.1."""

import asyncio

import pytest

from epp.prefix.kvindex import KVEventIndex, chain_keys
from epp.prefix.kvsubscriber import KVEventSubscriber
from epp.sim.kvevents import KVEventPublisher

BS = 4
POD = "127.0.0.1:8000"


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


async def _connected(pub, sub, replay=False):
    sub.follow(POD, pub.endpoint, pub.replay_endpoint if replay else None)
    # A SUB socket sees nothing sent before its subscription reached the publisher: probe until it has.
    while sub.stats.batches == 0:
        pub.cleared()
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


async def test_gap_is_replayed_from_the_replay_endpoint(pub, sub):
    await _connected(pub, sub, replay=True)
    tokens = list(range(16))
    _store_chain(pub, tokens)
    pub.flush(send=False)  # lost on the way: only the replay endpoint has it
    pub.removed([999])  # unrelated, makes the hole visible
    pub.flush()
    await _until(lambda: sub.stats.replays == 1)
    assert sub.stats.gaps == 1
    assert sub.index.match(chain_keys(tokens, BS))[POD][0] == 4 and sub.index.known(POD)


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
    finally:
        for s in subs:
            await s.close()


async def test_bound_socket_accepts_only_pool_pods_from_their_address():
    sub = KVEventSubscriber(KVEventIndex(), bind="tcp://127.0.0.1:*")
    sub.start()
    good = KVEventPublisher(sub.bound_endpoint, f"kv@{POD}@m")
    stranger = KVEventPublisher(sub.bound_endpoint, "kv@10.9.9.9:8000@m")
    try:
        sub.allow(POD)
        tokens = list(range(8))
        while POD not in sub.index.match(chain_keys(tokens, BS)):
            _store_chain(good, tokens)
            good.flush()
            stranger.cleared()
            stranger.flush()
            await asyncio.sleep(0.02)
        await _until(lambda: sub.stats.rejected_total > 0)
        assert sub.index.pods() == [POD]
    finally:
        good.close()
        stranger.close()
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
