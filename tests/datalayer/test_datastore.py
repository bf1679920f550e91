"""The pool (epp.datalayer.datastore): endpoint parsing, immutable snapshots and change listeners."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from epp.datalayer.datastore import Datastore
from epp.datalayer.inflight import InFlight
from epp.datalayer.static import parse_endpoint, parse_endpoints, read_endpoints_file
from epp.framework import Endpoint, Metrics


def _ep(hostport: str) -> Endpoint:
    return parse_endpoint(hostport)


# -- parsing ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "address", "port", "hostport"),
    [
        ("10.0.0.1:8000", "10.0.0.1", 8000, "10.0.0.1:8000"),
        ("  10.0.0.1:8000\n", "10.0.0.1", 8000, "10.0.0.1:8000"),
        ("127.0.0.1:1", "127.0.0.1", 1, "127.0.0.1:1"),
        ("127.0.0.1:65535", "127.0.0.1", 65535, "127.0.0.1:65535"),
        ("[fd00::1]:8000", "fd00::1", 8000, "[fd00::1]:8000"),
        ("[::1]:8000", "::1", 8000, "[::1]:8000"),
        # addresses are normalised, so the same pod is always the same hostport
        ("[FD00:0:0::0001]:8000", "fd00::1", 8000, "[fd00::1]:8000"),
        ("[10.0.0.1]:8000", "10.0.0.1", 8000, "10.0.0.1:8000"),
    ],
)
def test_parse_endpoint(text: str, address: str, port: int, hostport: str) -> None:
    endpoint = parse_endpoint(text)
    assert endpoint == Endpoint(name=hostport, address=address, port=port)
    assert endpoint.hostport == hostport


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10.0.0.1", "endpoint '10.0.0.1' is not ip:port"),
        (":8000", "endpoint ':8000' is not ip:port"),
        ("", "endpoint '' is not ip:port"),
        (
            "pod-a.default.svc:8000",
            "endpoint 'pod-a.default.svc:8000': 'pod-a.default.svc' is not an IP address "
            "(Envoy's ORIGINAL_DST cluster dials IPs, not names)",
        ),
        ("localhost:8000", "endpoint 'localhost:8000': 'localhost' is not an IP address"),
        ("10.0.0.256:8000", "endpoint '10.0.0.256:8000': '10.0.0.256' is not an IP address"),
        ("[fd00::1:8000", "endpoint '[fd00::1:8000': write an IPv6 address in brackets, as [address]:port"),
        ("10.0.0.1:0", "endpoint '10.0.0.1:0': port must be 1-65535"),
        ("10.0.0.1:65536", "endpoint '10.0.0.1:65536': port must be 1-65535"),
        ("10.0.0.1:", "endpoint '10.0.0.1:': port must be 1-65535"),
        ("10.0.0.1:http", "endpoint '10.0.0.1:http': port must be 1-65535"),
        ("10.0.0.1:-1", "endpoint '10.0.0.1:-1': port must be 1-65535"),
        ("10.0.0.1:+80", "endpoint '10.0.0.1:+80': port must be 1-65535"),
    ],
)
def test_parse_endpoint_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_endpoint(text)
    assert str(info.value).startswith(message)


# str.isdigit() is true for non-ASCII digits ("٣٠٠٠", "²"): ports must be ASCII.
@pytest.mark.parametrize("text", ["10.0.0.1:٣٠٠٠", "10.0.0.1:²"])
def test_parse_endpoint_rejects_non_ascii_port_digits(text: str) -> None:
    with pytest.raises(ValueError, match="port must be 1-65535"):
        parse_endpoint(text)


# "fd00::1:8000" is ambiguous (it is also a whole IPv6 address); Go's net.SplitHostPort rejects it.
@pytest.mark.parametrize("text", ["fd00::1:8000", "::1:8000"])
def test_parse_endpoint_rejects_unbracketed_ipv6(text: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(text)


@pytest.mark.parametrize(
    ("text", "hostports"),
    [
        ("", []),
        ("  ,, ", []),
        ("10.0.0.1:8000", ["10.0.0.1:8000"]),
        ("10.0.0.1:8000,10.0.0.2:8000", ["10.0.0.1:8000", "10.0.0.2:8000"]),
        ("10.0.0.2:8000 10.0.0.1:8000", ["10.0.0.2:8000", "10.0.0.1:8000"]),  # order kept
        ("10.0.0.1:8000,\n\t[fd00::1]:8000", ["10.0.0.1:8000", "[fd00::1]:8000"]),
        ("10.0.0.1:8000,10.0.0.1:8001", ["10.0.0.1:8000", "10.0.0.1:8001"]),  # same pod, two ports
    ],
)
def test_parse_endpoints(text: str, hostports: list[str]) -> None:
    assert [e.hostport for e in parse_endpoints(text)] == hostports


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10.0.0.1:8000,10.0.0.1:8000", "endpoint 10.0.0.1:8000 is listed twice"),
        ("[fd00::1]:8000 [FD00::0001]:8000", "endpoint [fd00::1]:8000 is listed twice"),
        ("10.0.0.1:8000,pod:8000", "endpoint 'pod:8000': 'pod' is not an IP address"),
    ],
)
def test_parse_endpoints_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_endpoints(text)
    assert str(info.value).startswith(message)


def test_read_endpoints_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text(
        "# pool for tests\n10.0.0.1:8000 # a\n\n  10.0.0.2:8000\n"
        "10.0.0.3:8000 inference.networking.k8s.io/engine-type=sglang zone=a\n#10.0.0.9:8000\n"
    )
    endpoints = read_endpoints_file(path)
    assert [e.hostport for e in endpoints] == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert endpoints[2].labels == {"inference.networking.k8s.io/engine-type": "sglang", "zone": "a"}
    assert endpoints[0].labels == {}
    assert read_endpoints_file(str(path)) == read_endpoints_file(path)


def test_read_endpoints_file_rejects_a_word_that_is_not_a_label(tmp_path: Path) -> None:
    path = tmp_path / "pool.txt"
    path.write_text("10.0.0.1:8000\n10.0.0.2:8000 10.0.0.3:8000\n")
    with pytest.raises(ValueError, match=r"pool.txt:2: '10.0.0.3:8000' is not a key=value label"):
        read_endpoints_file(path)


def test_read_endpoints_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_endpoints_file(tmp_path / "missing.txt")
    path = tmp_path / "dup.txt"
    path.write_text("10.0.0.1:8000\n10.0.0.1:8000 # again\n")
    with pytest.raises(ValueError, match="listed twice"):
        read_endpoints_file(path)


# -- the datastore ------------------------------------------------------------------------------

A, B, C = _ep("10.0.0.1:8000"), _ep("10.0.0.2:8000"), _ep("10.0.0.3:8000")


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Endpoint, ...], tuple[Endpoint, ...]]] = []

    def __call__(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        self.calls.append((added, removed))


def test_new_datastore() -> None:
    assert Datastore().endpoints() == ()
    assert not Datastore().ready
    store = Datastore([A, B])
    assert store.endpoints() == (A, B)
    assert store.ready


def test_replace_upsert_remove_notify_listeners() -> None:
    store = Datastore([A])
    recorder = _Recorder()
    store.subscribe(recorder)

    store.replace([A, B, C])
    assert store.endpoints() == (A, B, C)
    store.remove(B.name)
    assert store.endpoints() == (A, C)
    store.upsert(B)
    assert store.endpoints() == (A, C, B)
    store.replace([C])
    assert store.endpoints() == (C,)
    store.replace([])
    assert store.endpoints() == ()
    assert not store.ready

    assert recorder.calls == [
        ((B, C), ()),
        ((), (B,)),
        ((B,), ()),
        ((), (A, B)),
        ((), (C,)),
    ]


@pytest.mark.parametrize(
    "change",
    [
        lambda store: store.replace([A, B]),
        lambda store: store.replace([B, A]),  # same set, other order
        lambda store: store.upsert(A),
        lambda store: store.upsert(_ep("10.0.0.1:8000")),  # equal, not identical
        lambda store: store.remove("10.0.0.9:8000"),
    ],
)
def test_no_change_notifies_nobody(change) -> None:  # type: ignore[no-untyped-def]
    store = Datastore([A, B])
    recorder = _Recorder()
    store.subscribe(recorder)
    change(store)
    assert recorder.calls == []
    assert set(store.endpoints()) == {A, B}


def test_upsert_of_a_changed_endpoint_reports_it_added_and_removed() -> None:
    store = Datastore([A])
    recorder = _Recorder()
    store.subscribe(recorder)
    relabelled = Endpoint(name=A.name, address=A.address, port=A.port, labels={"zone": "b"})
    store.upsert(relabelled)
    assert store.endpoints() == (relabelled,)
    assert recorder.calls == [((relabelled,), (A,))]


def test_every_listener_hears_every_change() -> None:
    store = Datastore()
    first, second = _Recorder(), _Recorder()
    store.subscribe(first)
    store.subscribe(second)
    store.upsert(A)
    assert first.calls == second.calls == [((A,), ())]


def test_listener_sees_the_new_state() -> None:
    store = Datastore()
    seen: list[tuple[Endpoint, ...]] = []
    store.subscribe(lambda added, removed: seen.append(store.endpoints()))
    store.upsert(A)
    assert seen == [(A,)]


def test_snapshots_are_immutable() -> None:
    store = Datastore([A, B])
    snapshot = store.endpoints()
    by_hostport = store.by_hostport()
    store.upsert(C)
    store.remove(A.name)
    store.replace([])
    assert snapshot == (A, B)
    assert dict(by_hostport) == {"10.0.0.1:8000": A, "10.0.0.2:8000": B}
    assert isinstance(snapshot, tuple)
    with pytest.raises(TypeError):
        by_hostport["10.0.0.3:8000"] = C  # type: ignore[index]


def test_by_hostport() -> None:
    v6 = _ep("[fd00::1]:8000")
    store = Datastore([A, v6])
    assert dict(store.by_hostport()) == {"10.0.0.1:8000": A, "[fd00::1]:8000": v6}
    store.remove(A.name)
    assert dict(store.by_hostport()) == {"[fd00::1]:8000": v6}
    assert dict(Datastore().by_hostport()) == {}


def test_ready_follows_the_pool() -> None:
    store = Datastore()
    assert store.ready is False
    store.upsert(A)
    assert store.ready is True
    store.remove(A.name)
    assert store.ready is False


# -- in-flight accounting -----------------------------------------------------------------------------


def test_in_flight_counts_requests_sent_after_an_instant() -> None:
    inflight = InFlight()
    a = inflight.add(100, now=1.0)
    b = inflight.add(50, now=2.0)
    c = inflight.add(10, now=3.0)
    assert (inflight.requests, inflight.tokens) == (3, 160)
    assert inflight.since(0.5) == (3, 160)
    assert inflight.since(1.0) == (2, 60)  # sent at the scrape's own instant: the scrape saw it
    assert inflight.since(3.0) == (0, 0)
    inflight.release(b)
    inflight.release(b)  # twice: no effect
    assert (inflight.requests, inflight.tokens) == (2, 110)
    assert inflight.since(1.5) == (1, 10)
    inflight.release(a)
    inflight.release(c)
    assert (inflight.requests, inflight.tokens, inflight.since(0.0)) == (0, 0, (0, 0))


def test_queue_depth_and_kv_usage_add_what_was_sent_since_the_scrape() -> None:
    scraped = Metrics(waiting_queue_size=2, kv_cache_usage=0.5, num_gpu_blocks=100, block_size=16, updated_at=10.0, stale=False)
    endpoint = Endpoint("e", "10.0.0.1", 8000, metrics=scraped, inflight=InFlight())
    endpoint.inflight.add(800, now=9.0)  # before the scrape: already in its numbers
    assert (endpoint.queue_depth, endpoint.kv_usage) == (2, 0.5)
    endpoint.inflight.add(400, now=11.0)  # after: 400 of 1600 cache tokens
    assert endpoint.queue_depth == 3
    assert endpoint.kv_usage == pytest.approx(0.75)
    endpoint.inflight.add(10_000, now=12.0)
    assert endpoint.kv_usage == 1.0  # never above full
    no_cache_info = Endpoint("f", "10.0.0.2", 8000, metrics=Metrics(kv_cache_usage=0.3, updated_at=10.0), inflight=InFlight())
    no_cache_info.inflight.add(400, now=11.0)
    assert no_cache_info.kv_usage == 0.3  # cache size unknown: tokens cannot be turned into a share


def test_in_flight_record_survives_metrics_updates_and_relabels() -> None:
    datastore = Datastore([Endpoint("e", "10.0.0.1", 8000)])
    record = datastore.get("e").inflight
    record.add(1)
    datastore.update_metrics("e", Metrics(waiting_queue_size=1, stale=False))
    assert datastore.get("e").inflight is record
    datastore.upsert(Endpoint("e", "10.0.0.1", 8000, labels={"k": "v"}))
    assert datastore.get("e").inflight is record
    assert datastore.get("e").metrics.waiting_queue_size == 1
    datastore.remove("e")
    datastore.upsert(Endpoint("e", "10.0.0.1", 8000))
    assert datastore.get("e").inflight is not record  # a new pod under an old name starts at zero


def test_inflight_learns_the_prefill_time_per_token_from_requests_with_nothing_ahead() -> None:
    inflight = InFlight()
    assert inflight.seconds_per_token is None
    alone = inflight.add(1000, now=10.0)
    behind = inflight.add(3000, now=10.05)  # queued behind the first: its wait is not its prefill
    inflight.answering(alone, now=10.1)
    assert inflight.seconds_per_token == pytest.approx(1e-4)
    inflight.answering(behind, now=10.5)
    assert inflight.seconds_per_token == pytest.approx(1e-4)  # not a clean sample
    assert inflight.unanswered == 0
    again = inflight.add(1000, now=11.0)
    inflight.answering(again, now=11.2)  # 2e-4: a moving average, not a jump
    assert 1e-4 < inflight.seconds_per_token < 2e-4


def test_pending_depth_counts_the_request_in_prefill_by_how_much_of_it_is_left() -> None:
    inflight = InFlight()
    first = inflight.add(1000, now=0.0)
    assert inflight.pending_depth(now=5.0) == 1.0  # nothing learned yet: a whole request
    inflight.answering(first, now=0.1)  # 1e-4 s per token
    head = inflight.add(2000, now=1.0)  # 0.2 s of prefill expected
    inflight.add(500, now=1.05)  # behind it: counts 1 whatever happens
    assert inflight.pending_depth(now=1.0) == pytest.approx(2.0)
    assert inflight.pending_depth(now=1.1) == pytest.approx(1.75)
    assert inflight.pending_depth(now=1.2) == pytest.approx(1.5)
    assert inflight.pending_depth(now=9.0) == pytest.approx(1.5)  # overdue: still there, never below half
    inflight.answering(head, now=1.2)  # on time: the estimate stays; the next one's prefill starts now
    assert inflight.seconds_per_token == pytest.approx(1e-4)
    assert inflight.pending_depth(now=1.2) == pytest.approx(1.0)
    assert inflight.pending_depth(now=1.225) == pytest.approx(0.75)
    assert inflight.pending_depth(now=2.0) == pytest.approx(0.5)


def test_pending_depth_follows_answers_out_of_order_and_unanswered_releases() -> None:
    inflight = InFlight()
    warm = inflight.add(1000, now=0.0)
    inflight.answering(warm, now=0.1)
    a = inflight.add(1000, now=1.0)
    b = inflight.add(1000, now=1.01)
    c = inflight.add(1000, now=1.02)
    inflight.answering(b, now=1.03)  # a short one answered first: the head is still a
    assert inflight.unanswered == 2
    assert inflight.pending_depth(now=1.05) == pytest.approx(1.75)
    inflight.release(a)  # a's stream went away: c is the head, from now
    assert inflight.unanswered == 1
    assert 0.5 <= inflight.pending_depth() <= 1.0
    inflight.release(c)
    assert (inflight.unanswered, inflight.pending_depth()) == (0, 0.0)
    inflight.answering()  # nothing unanswered: no effect
    assert inflight.unanswered == 0


def test_queue_ahead_ranks_busy_pods_by_prefill_progress_and_idle_ones_first() -> None:
    now = time.monotonic()
    scraped = Metrics(updated_at=now, stale=False)  # taken after every send below
    nearly_done, just_started, idle = (Endpoint(n, "10.0.0.1", 8000, metrics=scraped, inflight=InFlight()) for n in "abc")
    for endpoint, sent in ((nearly_done, now - 0.09), (just_started, now - 0.01)):
        warm = endpoint.inflight.add(1000, now=sent - 10.0)
        endpoint.inflight.answering(warm, now=sent - 9.9)  # 1e-4 s per token: 0.1 s per prompt
        endpoint.inflight.add(1000, now=sent)
    assert idle.queue_ahead == 0
    assert 0.5 <= nearly_done.queue_ahead < just_started.queue_ahead <= 1.0
    assert nearly_done.queue_depth == just_started.queue_depth == 1  # the whole count, for filters and others
    # The scraped view still wins when it is larger.
    queued = replace(nearly_done, metrics=replace(scraped, waiting_queue_size=3))
    assert queued.queue_ahead == queued.queue_depth == 3


def test_an_unreachable_endpoint_stays_stale_until_a_scrape_succeeds_after_the_mark() -> None:
    store = Datastore([Endpoint("a", "10.0.0.1", 8000)])
    before = time.monotonic()
    store.update_metrics("a", Metrics(updated_at=before, stale=False))
    assert store.mark_unreachable("a", "Envoy could not connect")
    assert store.get("a").metrics.stale and store.get("a").metrics.error == "Envoy could not connect"
    # A failed scrape whose last success is recent still says "fresh": the mark holds.
    store.update_metrics("a", Metrics(updated_at=before, stale=False, error="timeout"))
    assert store.get("a").metrics.stale
    store.update_metrics("a", Metrics(updated_at=time.monotonic(), stale=False))
    assert not store.get("a").metrics.stale and store.get("a").metrics.error is None
    assert not store.mark_unreachable("gone", "x")
