"""In-flight records: the counts scorers read stay equal to the tickets they count."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datalayer.inflight import InFlight, Ticket

_OPS = st.lists(
    st.tuples(st.sampled_from(["add", "answer", "release", "answer-oldest"]), st.integers(0, 7), st.integers(0, 500)),
    max_size=60,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ops=_OPS)
def test_the_kept_counts_equal_the_tickets_after_any_operations(ops: list[tuple[str, int, int]]) -> None:
    record = InFlight()
    tickets: list[Ticket] = []
    clock = 0.0
    for op, which, tokens in ops:
        clock += 0.01
        if op == "add" or not tickets:
            tickets.append(record.add(tokens, now=clock if which % 3 else clock - 0.5))  # some sent "earlier"
        elif op == "answer":
            record.answering(tickets[which % len(tickets)], now=clock)
        elif op == "answer-oldest":
            record.answering(now=clock)
        else:
            record.release(tickets[which % len(tickets)])  # twice for some: a no-op
        open_ = [t for t in tickets if not t.released]
        assert record.requests == len(open_)
        assert record.tokens == sum(t.tokens for t in open_)
        assert record.unanswered == len([t for t in open_ if not t.answered])
        assert record.since(-1.0) == (len(open_), sum(t.tokens for t in open_))
    for ticket in tickets:
        record.release(ticket)
    assert (record.requests, record.tokens, record.unanswered, record.pending_depth()) == (0, 0, 0, 0.0)


def test_the_next_add_calls_the_watcher_once() -> None:
    record = InFlight()
    calls: list[int] = []
    record.on_next_add(lambda: calls.append(record.requests))
    record.add(3)
    record.add(4)
    assert calls == [1]  # once, with the request already counted
    record.on_next_add(lambda: calls.append(-1))
    record.on_next_add(None)  # forgotten
    record.add(5)
    assert calls == [1]
