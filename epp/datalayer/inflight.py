"""In-flight accounting: the requests this picker sent to one endpoint whose responses have not ended.

Design
------
Scraped metrics lag the requests the picker has just sent (a scrape every 50 ms; a burst arrives in
one). Each endpoint has one :class:`InFlight` record for its whole life in the pool, owned by the
datastore (carried across metrics updates and re-labels). The request path adds each request it
routes there (:meth:`InFlight.add` returns the request's :class:`Ticket`), marks when its response
starts (:meth:`InFlight.answering`) and releases it when the response ends, errors or is cancelled
(:meth:`InFlight.release`). Plugins read the record through the read-only
:class:`epp.framework.InFlightView`; :class:`epp.framework.Endpoint` derives the loads scorers read
from it.

Watching: :meth:`InFlight.on_next_add` lets the scraper hear the next request sent to an endpoint whose
scrapes it slowed down (the numbers of an idle pod change when this picker sends it work), at the
cost of one attribute test per request.

A ticket is the request's own entry, matched by identity: two requests sent at the same instant with
the same prompt size are still two entries, and releasing one twice is a no-op. The record keeps two
lists of tickets: every request in send order (for :meth:`since`, a bisect over send times), and the
unanswered ones in send order. ``requests``, ``unanswered`` and ``tokens`` (the prompt tokens' sum) are
plain attributes kept by the same statements that change the lists, not computed per read: scorers
read them for every pod on every request, and at 256 pods a property's call cost ~20 µs a request
(bench/scheduling_latency.py). A test checks them against the lists after random operations.

Prefill progress: the oldest unanswered request (the *head*) is the one the pod is prefilling (a pod
serves its queue first come, first served). Its prefill started when it was sent, or when the
request before it was answered, whichever is later. The record learns the pod's prefill time per
prompt token (``seconds_per_token``, a moving average) from the requests that found nothing
unanswered ahead of them: for those, send to first body byte is their own prefill alone.
:meth:`pending_depth` uses both to say how far along the head is (see there).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from operator import attrgetter

__all__ = ["InFlight", "Ticket"]

# Weight of each new sample in InFlight.seconds_per_token: about the last five clean requests, so the
# estimate follows a change of prompt mix or prefix-hit rate within a few requests while one outlier
# (a request slowed by another picker's traffic) moves it by a fifth.
_LEARNING_RATE = 0.2
_SENT = attrgetter("sent")


class Ticket:
    """One request counted in an :class:`InFlight` record."""

    __slots__ = ("answered", "clean", "released", "sent", "started", "tokens")

    def __init__(self, sent: float, tokens: int) -> None:
        self.sent = sent  # time.monotonic() when it was sent
        self.tokens = tokens  # estimated prompt tokens
        self.started: float | None = None  # when its prefill started (the head's; None behind it)
        self.clean = False  # it started with nothing unanswered ahead of it: a clean prefill sample
        self.answered = False  # its response body has started
        self.released = False

    def __repr__(self) -> str:
        return f"Ticket(sent={self.sent}, tokens={self.tokens}, answered={self.answered})"


class InFlight:
    """The requests this picker sent to one endpoint whose responses have not ended (see the module docstring)."""

    __slots__ = (
        "_memo", "_memo_key", "_on_add", "_sent", "_unanswered",
        "requests", "seconds_per_token", "tokens", "unanswered",
    )  # fmt: skip

    def __init__(self) -> None:
        self._sent: list[Ticket] = []  # every request in flight, by send time
        self._unanswered: list[Ticket] = []  # those whose response has not started, by send time
        self.tokens = 0  # sum of _sent's tokens
        self.requests = 0  # len(_sent)
        self.unanswered = 0  # len(_unanswered)
        self.seconds_per_token: float | None = None  # learned prefill time per prompt token
        # Several scorers ask since() of the same instant in one scheduling cycle.
        self._memo_key: float | None = None
        self._memo = (0, 0)
        self._on_add: Callable[[], None] | None = None

    def on_next_add(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` once, at the next :meth:`add` (None: forget the one set)."""
        self._on_add = callback

    def add(self, tokens: int = 0, now: float | None = None) -> Ticket:
        """Count one request (``tokens``: its estimated prompt tokens); the ticket answers and releases it."""
        ticket = Ticket(time.monotonic() if now is None else now, tokens)
        _insert_by_sent(self._sent, ticket)
        pending = self._unanswered
        if not pending:  # nothing ahead of it: its prefill starts now, and alone
            ticket.started = ticket.sent
            ticket.clean = True
        _insert_by_sent(pending, ticket)
        self.tokens += tokens
        self.requests += 1
        self.unanswered += 1
        self._memo_key = None
        callback = self._on_add
        if callback is not None:
            self._on_add = None
            callback()
        return ticket

    def answering(self, ticket: Ticket | None = None, now: float | None = None) -> None:
        """A request's response body has started (a second call for one ticket is a no-op).

        ``ticket``: which one (the oldest unanswered when not given). When it is the head and started
        with nothing ahead of it, its send-to-answer time per prompt token updates
        ``seconds_per_token``; the next request's prefill starts now.
        """
        pending = self._unanswered
        if ticket is None:
            if not pending:
                return
            ticket = pending[0]
        if ticket.answered or ticket.released:
            return
        ticket.answered = True
        index = _index_of(pending, ticket)
        if index is None:
            return
        del pending[index]
        self.unanswered -= 1
        at = time.monotonic() if now is None else now
        if index == 0:
            started = ticket.started
            if ticket.clean and ticket.tokens > 0 and started is not None and at > started:
                sample = (at - started) / ticket.tokens
                previous = self.seconds_per_token
                self.seconds_per_token = sample if previous is None else previous + _LEARNING_RATE * (sample - previous)
            _start_head(pending, at)

    def release(self, ticket: Ticket) -> None:
        """Stop counting the request ``ticket`` stands for (a second release is a no-op)."""
        if ticket.released:
            return
        index = _index_of(self._sent, ticket)
        if index is None:
            return
        ticket.released = True
        del self._sent[index]
        self.requests -= 1
        self.tokens -= ticket.tokens
        self._memo_key = None
        if not ticket.answered:  # its response never started (error, cancellation, no body seen)
            pending = self._unanswered
            where = _index_of(pending, ticket)
            if where is not None:
                del pending[where]
                self.unanswered -= 1
                if where == 0:
                    _start_head(pending, time.monotonic())

    def pending_depth(self, now: float | None = None) -> float:
        """The unanswered requests, the head counted by how much of its prefill is left.

        Each request behind the head counts 1. The head counts from 1 (its prefill just started, or
        nothing learned yet) down to 0.5 (its expected prefill time, ``seconds_per_token`` x its
        prompt tokens, has passed: it is about to answer, but has not). Never below 0.5, so a pod with
        a prefill under way always ranks behind one with none, whatever the estimate; between pods
        with the same number unanswered, the one nearer the end of its prefill ranks first. 0 when
        nothing is unanswered.

        Why 0.5 and not lower: a pod whose head is overdue (the estimate was short: a prompt with
        fewer cached tokens than usual, a slower pod) must still lose to an idle pod by more than the
        KV-cache scorer can add. Among pods that are all busy the floor does not matter: the queue
        scorer's min-max normalisation stretches their range to 0..1 anyway. (An offline replay of
        bench/routing_quality.py's workload c through the simulator's step model: TTFT P90 the same
        within 1% for learned rates 0.7x to 1.5x the true one with 0.5; with 0.05 a rate 0.7x the
        true one lost the gain.)
        """
        pending = self._unanswered
        if not pending:
            return 0.0
        depth = float(len(pending))
        rate = self.seconds_per_token
        head = pending[0]
        if rate is not None and head.tokens > 0:
            at = time.monotonic() if now is None else now
            started = head.sent if head.started is None else head.started
            done = (at - started) / (rate * head.tokens)  # share of the prefill done
            if done > 0.0:
                depth -= 0.5 * (done if done < 1.0 else 1.0)
        return depth

    def since(self, instant: float) -> tuple[int, int]:
        """(requests, tokens) still in flight that were sent after ``instant``."""
        if instant == self._memo_key:
            return self._memo
        sent = self._sent
        if not sent or sent[-1].sent <= instant:
            result = (0, 0)
        else:
            first = bisect.bisect_right(sent, instant, key=_SENT)
            tokens = sum(ticket.tokens for ticket in sent[first:]) if first else self.tokens
            result = (len(sent) - first, tokens)
        self._memo_key = instant
        self._memo = result
        return result


def _insert_by_sent(tickets: list[Ticket], ticket: Ticket) -> None:
    """Append ``ticket`` (only an explicit ``now`` can go back in time: then insert in order)."""
    if tickets and ticket.sent < tickets[-1].sent:
        tickets.insert(bisect.bisect_right(tickets, ticket.sent, key=_SENT), ticket)
    else:
        tickets.append(ticket)


def _index_of(tickets: list[Ticket], ticket: Ticket) -> int | None:
    """Where ``ticket`` itself is in ``tickets`` (sorted by send time), or None."""
    index = bisect.bisect_left(tickets, ticket.sent, key=_SENT)
    while index < len(tickets) and tickets[index].sent == ticket.sent:
        if tickets[index] is ticket:
            return index
        index += 1
    return None


def _start_head(pending: list[Ticket], at: float) -> None:
    """The head's prefill starts ``at`` (or when it was sent, if later), unless it already has."""
    if pending:
        head = pending[0]
        if head.started is None:
            head.started = at if head.sent < at else head.sent
