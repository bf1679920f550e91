"""One routed request, from its pick to the end of its response.

Design
------
The director makes a :class:`RoutedRequest` when it has picked a request's endpoints, and hands it
everything the rest of the request's life needs: the scheduler (for the lifecycle hooks), the primary
endpoint's in-flight record and the request's ticket in it, the model's metric series, and the
callable that wakes admission when a slot frees. From then on the edge (:mod:`epp.extproc`) calls
only this object, in the order the response arrives:

* :meth:`RoutedRequest.response_headers` when the response headers arrive (the status is kept; a
  404 is reported to ``not_found`` with the endpoint's name, so its model list is re-read; the
  plugins' ``response_received`` hooks may add response headers). A 503 that Envoy made itself
  (no ``x-envoy-upstream-service-time``, which Envoy adds to every answer a pod sent, and no
  ``x-envoy-overloaded``, its circuit breaker) means Envoy could not connect to the primary or lost
  it before its headers (observed with Envoy 1.40: ``:status`` 503, ``content-type: text/plain``,
  body "upstream connect error or disconnect/reset before headers. reset reason: remote connection
  failure"): the primary is reported ``unreachable``, so the next requests avoid it at once
  instead of after the scrape notices (the datastore clears the mark at its next good scrape);
* :meth:`RoutedRequest.response_body_started` on the first response body bytes (the pod has finished
  queueing and prefill: the request stops counting as unanswered);
* :meth:`RoutedRequest.response_ended` when the response body has ended, with its size and the token
  usage the model server reported in it (read by the edge from the end of the body);
* :meth:`RoutedRequest.finish` exactly once however the stream ends (``complete``, ``error``,
  ``cancelled``; a 5xx response counts as ``error``): the in-flight release, the running-requests
  gauge, admission's wake-up, the ``response_complete`` hooks, and for a complete response the
  response series (duration from the pick to the end, time to the first body byte, body size, input
  and output tokens, and the duration per output token, upstream's NTPOT).

Nothing here calls back into the director: a request's data goes one way, down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from epp.datalayer.inflight import InFlight, Ticket
from epp.framework import Endpoint, InferenceRequest, Outcome, SchedulingResult
from epp.requestcontrol.metrics import ModelMetrics
from epp.scheduling.runner import Scheduler

__all__ = ["RoutedRequest"]


def _nothing() -> None:
    pass


def _ignore(name: str) -> None:
    pass


def _nobody(name: str, why: str) -> None:
    pass


# Envoy adds the first to every answer a pod sent, the second to its circuit breaker's 503.
_FROM_POD = frozenset({"x-envoy-upstream-service-time", "x-envoy-overloaded"})
_UNREACHABLE = "Envoy could not reach it (its own 503 on the response path)"


class RoutedRequest:
    """A routed request: its pick, and the calls made while its response streams back."""

    __slots__ = (
        "_answering", "_finished", "_first_byte", "_hooks", "_in_flight", "_metrics", "_not_found", "_response_bytes",
        "_scheduler", "_sent", "_ticket", "_unreachable", "_usage", "_wake", "endpoints", "request", "result",
        "scores", "status",
    )  # fmt: skip

    def __init__(
        self,
        request: InferenceRequest,
        result: SchedulingResult,
        scheduler: Scheduler,
        in_flight: InFlight,
        metrics: ModelMetrics,
        *,
        wake: Callable[[], None] = _nothing,
        not_found: Callable[[str], None] = _ignore,
        unreachable: Callable[[str, str], object] = _nobody,
        hooks: Callable[[], object] | None = None,
    ) -> None:
        self.request = request
        self.result = result
        self.endpoints: list[Endpoint] = result.endpoints
        self.scores: dict[str, float] | None = None  # with --emit-endpoint-scores: ip:port -> its total score
        self.status = 0
        self._scheduler = scheduler
        self._in_flight = in_flight
        self._metrics = metrics
        self._wake = wake
        self._not_found = not_found
        self._unreachable = unreachable
        self._hooks = hooks  # the pick's pre_request hooks while they wait for its answer's write (director)
        self._finished = False
        self._answering = False
        self._sent = time.monotonic()
        self._first_byte = 0.0
        self._response_bytes = 0
        self._usage: tuple[int, int] | None = None
        # The request counts toward its primary's load from now until its response ends.
        self._ticket: Ticket = in_flight.add(request.prompt_tokens)
        metrics.running.inc()

    @property
    def primary(self) -> Endpoint:
        return self.endpoints[0]

    @property
    def destination(self) -> str:
        """The ``x-gateway-destination-endpoint`` value: primary first, then fallbacks."""
        return ",".join(endpoint.hostport for endpoint in self.endpoints)

    @property
    def response_bytes(self) -> int:
        """The response body's size, once it has ended."""
        return self._response_bytes

    @property
    def usage(self) -> tuple[int, int] | None:
        """The (prompt, output) tokens the model server reported, once the response has ended."""
        return self._usage

    @property
    def first_byte_after(self) -> float | None:
        """Seconds from the pick to the first response body byte, once it arrived."""
        return self._first_byte - self._sent if self._first_byte else None

    def response_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """The response headers arrived; returns the headers plugins ask to set on the response."""
        status = headers.get(":status", "")
        self.status = int(status) if status.isdigit() else 0
        if self.status == 404:  # the pod may not serve the model (any more): its list is re-read soon
            self._not_found(self.endpoints[0].name)
        if self.status == 503 and not _FROM_POD.intersection(headers):
            self._unreachable(self.endpoints[0].name, _UNREACHABLE)
        return self._scheduler.response_received(self.request, self.endpoints[0], headers)

    def response_body_started(self) -> None:
        """The first response body bytes arrived: the pod has finished queueing and prefill."""
        if not self._answering and not self._finished:
            self._answering = True
            self._first_byte = time.monotonic()
            self._in_flight.answering(self._ticket)

    def response_ended(self, size: int, usage: tuple[int, int] | None) -> None:
        """The response body ended: its size in bytes and the (prompt, output) tokens reported, if any."""
        self._response_bytes = size
        self._usage = usage

    def finish(self, outcome: Outcome = "complete") -> None:
        """The response ended (``complete``), failed (``error``) or the stream went away (``cancelled``)."""
        if self._finished:
            return
        self._finished = True
        hooks = self._hooks
        if hooks is not None:  # a request's pre_request hooks come before its end, whatever ends it first
            self._hooks = None
            hooks()
        if outcome == "complete" and self.status >= 500:
            outcome = "error"
        self._in_flight.release(self._ticket)
        metrics = self._metrics
        metrics.running.dec()
        if outcome == "complete":
            took = time.monotonic() - self._sent
            metrics.duration.observe(took)
            if self._first_byte:
                metrics.first_byte.observe(self._first_byte - self._sent)
            if self._response_bytes:
                metrics.response_sizes.observe(self._response_bytes)
            usage = self._usage
            if usage is not None:
                prompt_tokens, output_tokens = usage
                metrics.input_tokens.observe(prompt_tokens)
                metrics.output_tokens.observe(output_tokens)
                if output_tokens:
                    metrics.ntpot.observe(took / output_tokens)
        self._wake()  # a slot freed: a queued request may go
        self._scheduler.response_complete(self.request, self.endpoints[0], outcome)
