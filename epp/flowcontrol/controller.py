"""The central queue: requests wait in the picker, not on the GPUs, and leave by priority and turn.

Design
------
:meth:`FlowController.admit` is awaited by the director for each request before scheduling. It
returns when the request is *dispatched* (the director then picks an endpoint at once), or raises
:class:`~epp.flowcontrol.outcomes.FlowControlError` (429 or 503 with a dropped-reason), or, when the
awaiting task is cancelled because the client went away, removes the entry on the spot and lets
``CancelledError`` through.

Structure. Requests live in *priority bands* (one per priority value; a band not listed in the
config is created from the default, or default-negative, template when its first request arrives and
dropped when it empties). Inside a band, requests belong to *flows* (the fairness id). Each entry
sits in two insertion-ordered maps, the band's (arrival order) and its flow's, so removing any entry
(dispatch, TTL, cancellation) is O(1) and an empty flow disappears at once: nothing is kept for a
request that left.

Dispatch, one request at a time:

1. strict priority: the highest non-empty band goes first;
2. between the flows of that band, the band's fairness policy: ``global-strict-fairness-policy``
   takes the band's oldest request whatever its flow (global FCFS); ``round-robin-fairness-policy``
   serves the flows in turn (a flow that was served, or that just became non-empty, goes to the back
   of the ring), so backlogged flows get equal service whatever their arrival rates;
3. inside a flow, first come first served.

Gate. Nothing is dispatched while ``saturation() >= 1.0`` (the detector reads 1.0 for an empty pool,
so a pool scaled to zero holds requests until a pod appears or their budget ends). After each
dispatch the dispatcher gives the event loop one turn before it looks at saturation again: the
released request's task runs first, up to its first ``await``, so a director that schedules and
counts the request in flight without awaiting in between is seen by the next saturation check
(otherwise one metrics update could release the whole queue). Dispatch runs as ``call_soon``
callbacks, started by an arrival and by :meth:`FlowController.wake`, which the director calls
whenever capacity may have changed (metrics update, a response finished, a pod joined or left): no
polling delay. A slow safety timer (``safety_interval``, 0.25 s) retries while the queue is
non-empty and saturated, in case a wake was missed.

Admission. A request arriving at an empty queue with the pool unsaturated passes at once, without
queueing. Otherwise it is queued unless that would exceed its band's ``maxRequests``/``maxBytes`` or
the global ones (429 ``rejected-saturated``; 503 ``rejected-no-endpoints`` when the pool is empty).

Budget. A queued request may wait ``defaultRequestTTL`` while the pool has endpoints and
``noEndpointRequestTTL`` while it has none (0: no limit). When the pool changes between the two
(noticed on any wake), every queued request gets a fresh budget for the new regime, and total wait
stays bounded by the longer budget, as upstream. Expiry answers 503 (``rejected-ttl-expired``, or
``rejected-no-endpoints`` if the pool is empty). A request's own ``ttl`` overrides both.

Everything runs on the event loop thread (no locks): call :meth:`~FlowController.wake` from it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from epp.flowcontrol.config import GLOBAL_STRICT, BandConfig, FlowControlConfig
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.outcomes import DEFAULT_FLOW_ID, FlowControlError, Outcome
from epp.flowcontrol.saturation import SATURATION_THRESHOLD

__all__ = ["Admission", "FlowController", "LegacyAdmission"]

log = logging.getLogger(__name__)

Saturation = Callable[[], "float | bool"]


class _Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Where request TTLs are read and timed: the running event loop (its ``time`` and ``call_at``)
    unless one is given, as tests give a manual one."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> _Timer: ...


class _Request(Protocol):
    priority: int
    flow_id: str
    byte_size: int


class Admission(Protocol):
    """What the director calls: :class:`FlowController` (flow control on) or :class:`LegacyAdmission`."""

    async def admit(self, request: Any) -> float: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class _Entry:
    __slots__ = ("band", "byte_size", "enqueued_at", "flow_id", "future", "queued", "request", "seq", "timer")

    def __init__(
        self, seq: int, request: Any, future: asyncio.Future[float], now: float, band: _Band, flow_id: str, size: int
    ) -> None:
        self.seq = seq
        self.request = request
        self.future = future
        self.enqueued_at = now
        self.band = band
        self.flow_id = flow_id
        self.byte_size = size
        self.timer: _Timer | None = None
        self.queued = True


class _Band:
    """One priority's queue: every entry in arrival order, and per flow."""

    __slots__ = ("bytes", "config", "configured", "count", "entries", "flows")

    def __init__(self, config: BandConfig, configured: bool) -> None:
        self.config = config
        self.configured = configured
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        # Non-empty flows only, in round-robin order (the head is served next).
        self.flows: OrderedDict[str, OrderedDict[int, _Entry]] = OrderedDict()
        self.count = 0
        self.bytes = 0

    def add(self, entry: _Entry) -> None:
        self.entries[entry.seq] = entry
        flow = self.flows.get(entry.flow_id)
        if flow is None:
            flow = self.flows[entry.flow_id] = OrderedDict()  # a newly active flow joins the back of the ring
        flow[entry.seq] = entry
        self.count += 1
        self.bytes += entry.byte_size

    def remove(self, entry: _Entry) -> None:
        del self.entries[entry.seq]
        flow = self.flows[entry.flow_id]
        del flow[entry.seq]
        if not flow:
            del self.flows[entry.flow_id]
        self.count -= 1
        self.bytes -= entry.byte_size

    def next_entry(self) -> _Entry:
        """The entry the band's fairness policy serves next (the band is not empty)."""
        if self.config.fairness == GLOBAL_STRICT:
            return next(iter(self.entries.values()))
        flow_id, flow = next(iter(self.flows.items()))
        if len(flow) > 1:
            self.flows.move_to_end(flow_id)  # served: back of the ring
        return next(iter(flow.values()))


class FlowController:
    """The central queue. See the module docstring for the policy.

    ``saturation()`` returns the pool's saturation (dispatch stops at >= 1.0; a bool works too:
    True is saturated). ``has_endpoints()`` tells an empty pool apart (which TTL budget applies, and
    429 versus 503). ``metrics``: optional :class:`FlowControlMetrics`.
    """

    def __init__(
        self,
        config: FlowControlConfig,
        saturation: Saturation,
        *,
        has_endpoints: Callable[[], bool] = lambda: True,
        metrics: FlowControlMetrics | None = None,
        safety_interval: float = 0.25,
        clock: Clock | None = None,
    ) -> None:
        if not safety_interval > 0:
            raise ValueError(f"safety_interval must be > 0, got {safety_interval}")
        self.config = config
        self._saturation_fn = saturation
        self._has_endpoints = has_endpoints
        self._metrics = metrics
        self._safety_interval = safety_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock: Clock | None = clock  # None: the running loop's clock and timers
        self._bands: dict[int, _Band] = {}
        self._order: list[int] = []  # band priorities, highest first
        self._count = 0
        self._bytes = 0
        self._seq = 0
        self._step_scheduled = False
        self._safety: asyncio.TimerHandle | None = None
        self._pool_empty: bool | None = None
        self._closed = False
        for band in config.bands.values():
            self._add_band(band, configured=True)

    # --- what the director calls ------------------------------------------------------------

    async def admit(self, request: _Request) -> float:
        """Wait until ``request`` may be scheduled; returns the seconds it waited.

        Raises FlowControlError when refused or evicted; cancelling the awaiting task removes the
        request from the queue.
        """
        priority, flow_id, size, ttl = _read_request(request)
        if self._closed:
            self._record(priority, Outcome.REJECTED_OTHER, 0.0)
            raise FlowControlError(Outcome.REJECTED_OTHER, "the picker is shutting down")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        clock = self._clock
        if clock is None:
            clock = self._clock = loop
        if self._count == 0 and not self._saturated():
            self._record(priority, Outcome.DISPATCHED, 0.0)
            return 0.0

        band = self._bands.get(priority)
        if band is None:
            band = self._add_band(self.config.band(priority), configured=False)
        refused = self._over_limit(band, size)
        if refused:
            self._drop_band_if_idle(band)
            empty = self._pool_is_empty()
            outcome = Outcome.REJECTED_NO_ENDPOINTS if empty else Outcome.REJECTED_CAPACITY
            self._record(priority, outcome, 0.0)
            raise FlowControlError(outcome, f"the request queue is full ({refused})")

        self._check_regime()
        self._seq += 1
        entry = _Entry(self._seq, request, loop.create_future(), clock.time(), band, flow_id, size)
        band.add(entry)
        self._count += 1
        self._bytes += size
        if self._metrics is not None:
            self._metrics.record_queued(priority, 1, size)
        self._arm_ttl(entry, ttl)
        self._schedule_step()
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry.queued:  # the client went away while queued: drop the entry now
                self._remove(entry, Outcome.EVICTED_CANCELLED)
            raise

    def wake(self) -> None:
        """Capacity may have changed: try to dispatch on the next loop turn."""
        if self._count and not self._closed:
            self._schedule_step()

    def close(self) -> None:
        """Refuse new requests and answer every queued one 503 (``rejected-shutting-down``)."""
        self._closed = True
        if self._safety is not None:
            self._safety.cancel()
            self._safety = None
        for band in list(self._bands.values()):
            for entry in list(band.entries.values()):
                cancelled = entry.future.done()
                self._remove(entry, Outcome.EVICTED_CANCELLED if cancelled else Outcome.EVICTED_OTHER)
                if not cancelled:
                    entry.future.set_exception(FlowControlError(Outcome.EVICTED_OTHER, "the picker is shutting down"))

    # --- introspection (tests, debugging) ------------------------------------------------------

    @property
    def queued(self) -> int:
        return self._count

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def bands(self) -> dict[int, tuple[int, int]]:
        """Priority -> (requests, bytes) for every band that exists right now."""
        return {p: (b.count, b.bytes) for p, b in self._bands.items()}

    def flows(self, priority: int) -> dict[str, int]:
        """Flow id -> queued requests, for the flows of ``priority``'s band that hold any."""
        band = self._bands.get(priority)
        return {} if band is None else {flow_id: len(flow) for flow_id, flow in band.flows.items()}

    # --- internals ----------------------------------------------------------------------------

    def _add_band(self, config: BandConfig, *, configured: bool) -> _Band:
        band = self._bands[config.priority] = _Band(config, configured)
        self._order = sorted(self._bands, reverse=True)
        return band

    def _drop_band_if_idle(self, band: _Band) -> None:
        # Bands nobody configured are created on demand; drop them when empty so none lingers.
        if not band.configured and band.count == 0:
            del self._bands[band.config.priority]
            self._order = sorted(self._bands, reverse=True)

    def _over_limit(self, band: _Band, size: int) -> str:
        cfg = self.config
        if cfg.max_requests and self._count + 1 > cfg.max_requests:
            return f"{self._count} requests queued, global maxRequests {cfg.max_requests}"
        if cfg.max_bytes and self._bytes + size > cfg.max_bytes:
            return f"{self._bytes} + {size} bytes over global maxBytes {cfg.max_bytes}"
        if band.count + 1 > band.config.max_requests:
            config = band.config
            return f"{band.count} requests queued at priority {config.priority}, maxRequests {config.max_requests}"
        if band.bytes + size > band.config.max_bytes:
            return (
                f"{band.bytes} + {size} bytes over maxBytes {band.config.max_bytes} at priority {band.config.priority}"
            )
        return ""

    def _saturated(self) -> bool:
        try:
            value = float(self._saturation_fn())
        except Exception:  # a broken detector must not kill dispatch: hold, and retry on the safety timer
            log.exception("saturation detector failed; treating the pool as saturated")
            return True
        if self._metrics is not None:
            self._metrics.record_saturation(value)
        # An empty pool holds requests whatever the callable says; NaN counts as saturated.
        return not value < SATURATION_THRESHOLD or self._pool_is_empty()

    def _pool_is_empty(self) -> bool:
        try:
            return not self._has_endpoints()
        except Exception:
            log.exception("has_endpoints failed; assuming the pool is not empty")
            return False

    def _schedule_step(self) -> None:
        if not self._step_scheduled and self._loop is not None:
            self._step_scheduled = True
            self._loop.call_soon(self._step)

    def _step(self) -> None:
        self._step_scheduled = False
        if self._closed or not self._count:
            return
        self._check_regime()
        if self._saturated():
            if self._safety is None:
                self._safety = self._loop.call_later(self._safety_interval, self._safety_fired)  # type: ignore[union-attr]
            return
        while self._count:
            entry = self._next_entry()
            if entry.future.done():
                # Cancelled a moment ago; its task has not run its cleanup yet. Drop it here.
                self._remove(entry, Outcome.EVICTED_CANCELLED)
                continue
            entry.future.set_result(self._remove(entry, Outcome.DISPATCHED))
            break
        if self._count:
            # One turn of the loop first: the request just released runs up to its first await
            # (scheduling, in-flight accounting) before saturation is read again.
            self._schedule_step()

    def _next_entry(self) -> _Entry:
        """Strict priority between bands, then the band's fairness policy (the queue is not empty)."""
        for priority in self._order:
            band = self._bands[priority]
            if band.count:
                return band.next_entry()
        raise AssertionError("the queue count says non-empty but every band is empty")

    def _safety_fired(self) -> None:
        self._safety = None
        self.wake()

    def _remove(self, entry: _Entry, outcome: Outcome) -> float:
        """Take ``entry`` out of the queue for ``outcome``; returns how long it waited."""
        entry.queued = False
        band = entry.band
        band.remove(entry)
        self._count -= 1
        self._bytes -= entry.byte_size
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        self._drop_band_if_idle(band)
        assert self._clock is not None
        waited = self._clock.time() - entry.enqueued_at
        priority = band.config.priority
        if self._metrics is not None:
            self._metrics.record_queued(priority, -1, -entry.byte_size)
        self._record(priority, outcome, waited)
        if not self._count and self._safety is not None:
            self._safety.cancel()
            self._safety = None
        return waited

    def _record(self, priority: int, outcome: Outcome, waited: float) -> None:
        if self._metrics is not None:
            self._metrics.record_outcome(priority, outcome, waited)

    def _check_regime(self) -> None:
        """Notice the pool going empty or non-empty; queued requests then get the new budget."""
        empty = self._pool_is_empty()
        if empty == self._pool_empty:
            return
        first = self._pool_empty is None
        self._pool_empty = empty
        if first:
            return
        for band in self._bands.values():
            for entry in band.entries.values():
                if _own_ttl(entry.request) is None:
                    self._arm_ttl(entry, None)

    def _arm_ttl(self, entry: _Entry, ttl: float | None) -> None:
        clock = self._clock
        assert clock is not None
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        now = clock.time()
        if ttl is not None:
            deadline = entry.enqueued_at + ttl
        else:
            cfg = self.config
            budget = cfg.no_endpoint_request_ttl if self._pool_empty else cfg.default_request_ttl
            if budget <= 0:
                return  # this regime has no budget: wait for dispatch, the client, or shutdown
            deadline = now + budget
            if cfg.default_request_ttl > 0 and cfg.no_endpoint_request_ttl > 0:
                # A regime change grants a fresh budget but never past the longer one overall.
                deadline = min(deadline, entry.enqueued_at + max(cfg.default_request_ttl, cfg.no_endpoint_request_ttl))
        entry.timer = clock.call_at(max(deadline, now), self._expire, entry)

    def _expire(self, entry: _Entry) -> None:
        entry.timer = None
        if not entry.queued or entry.future.done():
            return
        empty = self._pool_is_empty()
        outcome = Outcome.EVICTED_NO_ENDPOINTS if empty else Outcome.EVICTED_TTL
        waited = self._remove(entry, outcome)
        if empty:
            message = f"no endpoint became available within {waited:.3g}s"
        else:
            message = f"the pool stayed saturated for the request's whole queue budget ({waited:.3g}s)"
        entry.future.set_exception(FlowControlError(outcome, message))


class LegacyAdmission:
    """Admission without flow control (upstream's default): while the pool is saturated a
    sheddable request (priority < 0) is refused with 429; everything else passes at once."""

    def __init__(self, saturation: Saturation, *, metrics: FlowControlMetrics | None = None) -> None:
        self._saturation_fn = saturation
        self._metrics = metrics

    async def admit(self, request: _Request) -> float:
        priority = request.priority
        if priority < 0:
            try:
                value = float(self._saturation_fn())
            except Exception:
                log.exception("saturation detector failed; treating the pool as saturated")
                value = SATURATION_THRESHOLD
            if self._metrics is not None:
                self._metrics.record_saturation(value)
            if not value < SATURATION_THRESHOLD:
                if self._metrics is not None:
                    self._metrics.record_outcome(priority, Outcome.REJECTED_SATURATED, 0.0)
                raise FlowControlError(
                    Outcome.REJECTED_SATURATED, "the pool is saturated and this request is sheddable"
                )
        return 0.0

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def _own_ttl(request: Any) -> float | None:
    return getattr(request, "ttl", None)


def _read_request(request: Any) -> tuple[int, str, int, float | None]:
    priority = request.priority
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise TypeError(f"priority must be an int, got {priority!r}")
    flow_id = getattr(request, "flow_id", "") or DEFAULT_FLOW_ID
    if not isinstance(flow_id, str):
        raise TypeError(f"flow_id must be a str, got {flow_id!r}")
    size = getattr(request, "byte_size", 0)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"byte_size must be an int >= 0, got {size!r}")
    ttl = _own_ttl(request)
    if ttl is not None and not ttl >= 0:
        raise ValueError(f"ttl must be >= 0 seconds, got {ttl!r}")
    return priority, flow_id, size, ttl
