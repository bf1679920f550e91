"""The scheduling runner: drives the configured plugins for one request, each call timed and isolated.

Design
------
:class:`Scheduler` is built once from the configuration (profiles, an optional profile handler, the
producers in dependency order, the plugins with lifecycle hooks) and is then read-only. Per request
it runs the producers, then the profiles the handler chooses (filters, weighted scorers, picker; see
:mod:`epp.framework.roles` for the roles), and later the lifecycle hooks. It is pure, synchronous CPU
work over immutable endpoint snapshots; anything that waits lives in :mod:`epp.requestcontrol`.

Every plugin call site is a :class:`_Site`, bound once at build time to its plugin, its weight and
its instrument (``instrument(extension_point, plugin) -> (observe, failed)``; the service binds them
to ``inference_extension_plugin_duration_seconds`` and ``epp_plugin_errors_total``). A call that raises
or returns something malformed is *isolated* (never a failed request, never the other plugins
skipped):

=================  ==========================================================================
call fails         the request goes on as if
=================  ==========================================================================
producer           it stored nothing (consumers find no data and abstain)
profile handler    it had chosen the first configured profile, and that profile's result
filter             it kept every candidate
scorer             it scored 0 everywhere (also: wrong number of scores, scores not numbers)
picker             it picked the best total score (ties: the first)
lifecycle hook     it was not there; the other hooks still run
=================  ==========================================================================

Scores are clamped to [0, 1] and a NaN counts as 0; such scores also count as the scorer's error
(``malformed``), since a scorer that produces them is buggy. Failures are logged with the
traceback on the first one at a site, then at most once a minute per site with how many were
suppressed (:class:`_Site`): a plugin failing on every request must not flood the log.

With one profile and no handler (or a handler declaring ``single_profile``), the handler's rounds
are skipped.
"""

from __future__ import annotations

import logging
import math
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epp.framework import (
    DataProducer,
    Endpoint,
    InferenceRequest,
    LogLimiter,
    Outcome,
    PrepareData,
    PreRequest,
    Profile,
    ProfileHandler,
    ResponseComplete,
    ResponseReceived,
    SchedulingResult,
    ScoredCandidates,
)
from epp.scheduling.decisions import DecisionRecord, decisions, log_decision

__all__ = ["Instrument", "Scheduler", "no_instrument"]

log = logging.getLogger(__name__)

# ``instrument(extension_point, plugin)`` -> (observe(seconds), failed(kind)); kind is ``exception``
# or ``malformed``.
Instrument = Callable[[str, object], tuple[Callable[[float], None], Callable[[str], None]]]

_LOG_EVERY = 60.0  # seconds between two logged failures of one call site


def _ignore_duration(seconds: float) -> None:
    pass


def _ignore_failure(kind: str) -> None:
    pass


def no_instrument(extension_point: str, plugin: object) -> tuple[Callable[[float], None], Callable[[str], None]]:
    """An instrument that records nothing (failures are still logged)."""
    return _ignore_duration, _ignore_failure


class _Site:
    """One plugin at one extension point: its duration and failure recording, and its log limiter."""

    __slots__ = ("_failed", "_limit", "extension_point", "observe", "plugin", "weight")

    def __init__(self, extension_point: str, plugin: Any, instrument: Instrument, weight: float = 1.0) -> None:
        self.extension_point = extension_point
        self.plugin = plugin
        self.weight = weight
        self.observe, self._failed = instrument(extension_point, plugin)
        self._limit = LogLimiter(_LOG_EVERY)

    def failed(self, request: InferenceRequest, kind: str, what: str, *, exc_info: bool = False) -> None:
        """Count and (rate-limited) log a failure of this site for ``request``."""
        self._failed(kind)
        suppressed = self._limit.allow()
        if suppressed is None:
            return
        log.error(
            "%s plugin %r %s (request %s); the request goes on without it%s",
            self.extension_point,
            getattr(self.plugin, "name", "?"),
            what,
            request.request_id or "?",
            f"; {suppressed} more failure(s) here in the last {_LOG_EVERY:.0f}s not logged" if suppressed else "",
            exc_info=exc_info,
        )


class _CompiledProfile:
    __slots__ = ("filters", "picker", "profile", "scorers")

    def __init__(self, profile: Profile, instrument: Instrument) -> None:
        self.profile = profile
        self.filters = [_Site("Filter", f, instrument) for f in profile.filters]
        self.scorers = [_Site("Scorer", w.scorer, instrument, w.weight) for w in profile.scorers]
        self.picker = _Site("Picker", profile.picker, instrument)


def _accumulate(totals: list[float], scores: Sequence[float], weight: float) -> tuple[list[float], bool]:
    """``totals + weight * clamp(scores)``, and whether every score was a number in [0, 1].

    Scores are clamped to [0, 1], NaN counting as 0 (a buggy scorer must not win). Whole-list passes
    in C when every score is in range, the usual case. TypeError when a score is not a number.
    """
    total = sum(scores)
    if total == total and min(scores) >= 0.0 and max(scores) <= 1.0:  # no NaN, none out of range
        weighted = scores if weight == 1.0 else map(weight.__mul__, scores)
        return list(map(operator.add, totals, weighted)), True
    clamped = [0.0 if math.isnan(v) or v < 0.0 else 1.0 if v > 1.0 else v for v in scores]
    return [t + weight * v for t, v in zip(totals, clamped, strict=True)], False


class Scheduler:
    """Runs the configured producers, profile handler and profiles for one request.

    ``profiles`` keeps the configuration's order. ``handler``: None with one profile (it simply runs).
    ``producers`` must already be in dependency order. ``hooks`` are every configured plugin; those
    with lifecycle methods are found here.
    """

    def __init__(
        self,
        profiles: Profile | Sequence[Profile],
        *,
        handler: ProfileHandler | None = None,
        producers: Sequence[DataProducer] = (),
        hooks: Sequence[object] = (),
        instrument: Instrument = no_instrument,
    ) -> None:
        if isinstance(profiles, Profile):
            profiles = (profiles,)
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        if handler is None and len(profiles) > 1:
            raise ValueError(f"{len(profiles)} profiles need a profile handler to choose between them")
        self.profiles: dict[str, Profile] = {p.name: p for p in profiles}
        self.handler = handler
        self._handler = _Site("ProfileHandler", handler, instrument) if handler is not None else None
        self._producers = [_Site("DataProducer", p, instrument) for p in producers]
        self._compiled = {p.name: _CompiledProfile(p, instrument) for p in profiles}
        self._prepare = [_Site("PrepareData", h, instrument) for h in hooks if isinstance(h, PrepareData)]
        self._pre_request = [_Site("PreRequest", h, instrument) for h in hooks if isinstance(h, PreRequest)]
        self._received = [_Site("ResponseReceived", h, instrument) for h in hooks if isinstance(h, ResponseReceived)]
        self._complete = [_Site("ResponseComplete", h, instrument) for h in hooks if isinstance(h, ResponseComplete)]
        single = len(self.profiles) == 1 and (handler is None or getattr(handler, "single_profile", False) is True)
        self._single = self._compiled[next(iter(self.profiles))] if single else None

    @property
    def profile(self) -> Profile:
        """The first (with a single-profile configuration: the only) profile."""
        return next(iter(self.profiles.values()))

    # -- scheduling ---------------------------------------------------------------------------

    @property
    def prepares(self) -> bool:
        """Whether a configured plugin prepares data (so :meth:`prepare` is worth awaiting)."""
        return bool(self._prepare)

    async def prepare(self, request: InferenceRequest) -> None:
        """Await every ``prepare_data`` in turn (before admission; see :class:`epp.framework.PrepareData`)."""
        clock = time.perf_counter
        for site in self._prepare:
            started = clock()
            try:
                await site.plugin.prepare_data(request)
            except Exception:
                site.failed(request, "exception", "raised", exc_info=True)
            site.observe(clock() - started)

    def schedule(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints to try, primary first; empty when no candidate survives."""
        return self.run(request, candidates).endpoints

    def run(
        self, request: InferenceRequest, candidates: Sequence[Endpoint], records: list[DecisionRecord] | None = None
    ) -> SchedulingResult:
        """Producers, then the profile handler's profiles; every profile's result.

        ``records``: a list the runner fills with each profile's :class:`DecisionRecord` (a traced
        request's scores); they are also made, and logged, while decision records are on.
        """
        clock = time.perf_counter
        for site in self._producers:
            started = clock()
            try:
                site.plugin.produce(request, candidates)
            except Exception:
                site.failed(request, "exception", "raised", exc_info=True)
            site.observe(clock() - started)
        single = self._single
        logged = decisions.isEnabledFor(logging.INFO)
        if records is None and logged:
            records = []
        if single is not None:
            name = single.profile.name
            result = SchedulingResult({name: self._run_profile(single, request, candidates, records)}, name)
        else:
            result = self._run_handler(request, candidates, records)
        if logged and records is not None:
            log_decision(request, records, result.primary_profile)
        return result

    def _run_handler(
        self,
        request: InferenceRequest,
        candidates: Sequence[Endpoint],
        records: list[DecisionRecord] | None,
    ) -> SchedulingResult:
        site = self._handler
        assert site is not None  # several profiles always have one (see __init__)
        handler = site.plugin
        clock = time.perf_counter
        results: dict[str, list[Endpoint]] = {}
        while True:
            started = clock()
            try:
                chosen = list(handler.pick_profiles(request, self.profiles, results))
                unknown = [p for p in chosen if getattr(p, "name", None) not in self._compiled or p.name in results]
                if unknown:
                    raise ValueError(f"picked {[getattr(p, 'name', p) for p in unknown]}: unknown, or picked twice")
            except Exception:
                site.observe(clock() - started)
                site.failed(request, "exception", "failed to choose profiles", exc_info=True)
                return self._fallback_profile(request, candidates, results, records)
            site.observe(clock() - started)
            if not chosen:
                break
            for profile in chosen:
                results[profile.name] = self._run_profile(self._compiled[profile.name], request, candidates, records)
        if not results:
            return SchedulingResult({}, "")
        started = clock()
        try:
            primary = handler.process_results(request, results)
            if primary not in results:
                raise ValueError(f"named {primary!r}, which did not run")
        except Exception:
            site.failed(request, "exception", "failed to name the primary profile", exc_info=True)
            primary = next((name for name, endpoints in results.items() if endpoints), next(iter(results)))
        site.observe(clock() - started)
        return SchedulingResult(results, primary)

    def _fallback_profile(
        self,
        request: InferenceRequest,
        candidates: Sequence[Endpoint],
        results: dict[str, list[Endpoint]],
        records: list[DecisionRecord] | None,
    ) -> SchedulingResult:
        """The handler failed: route by the first configured profile (run now if it has not run)."""
        first = next(iter(self._compiled.values()))
        name = first.profile.name
        if name not in results:
            results[name] = self._run_profile(first, request, candidates, records)
        return SchedulingResult(results, name)

    def _run_profile(
        self,
        compiled: _CompiledProfile,
        request: InferenceRequest,
        candidates: Sequence[Endpoint],
        records: list[DecisionRecord] | None = None,
    ) -> list[Endpoint]:
        record = DecisionRecord(compiled.profile.name, candidates) if records is not None else None
        picked = self._profile_pick(compiled, request, candidates, record)
        if record is not None and records is not None:
            record.picked = [e.name for e in picked]
            records.append(record)
        return picked

    def _profile_pick(
        self,
        compiled: _CompiledProfile,
        request: InferenceRequest,
        candidates: Sequence[Endpoint],
        record: DecisionRecord | None,
    ) -> list[Endpoint]:
        clock = time.perf_counter
        for site in compiled.filters:
            if not candidates:
                return []
            started = clock()
            try:
                kept = site.plugin.filter(request, candidates)
                if not isinstance(kept, (list, tuple)):
                    raise TypeError(f"returned {type(kept).__name__}, not a list of endpoints")
                candidates = kept
            except Exception:
                site.failed(request, "exception", "failed; its input passes through", exc_info=True)
            site.observe(clock() - started)
            if record is not None:
                record.filtered(site.plugin.name, candidates)
        if record is not None:
            record.scored_candidates = candidates
        if not candidates:
            return []
        count = len(candidates)
        totals: list[float] = [0.0] * count
        for site in compiled.scorers:
            started = clock()
            try:
                scores = site.plugin.score(request, candidates)
            except Exception:
                site.observe(clock() - started)
                site.failed(request, "exception", "failed; scored 0", exc_info=True)
                continue
            site.observe(clock() - started)  # the plugin's own time: accumulating is the runner's
            try:
                if len(scores) != count:
                    site.failed(request, "malformed", f"returned {len(scores)} scores for {count} candidates; scored 0")
                    continue
                totals, clean = _accumulate(totals, scores, site.weight)
                if record is not None:
                    record.scored(site.plugin.name, site.weight, scores)
            except Exception:  # no length, or scores that are not numbers
                site.failed(request, "malformed", "returned something that is not one number per candidate; scored 0")
                continue
            if not clean:
                site.failed(request, "malformed", "returned scores outside [0, 1] or NaN (clamped; NaN counts 0)")
        if record is not None:
            record.totals = totals
        site = compiled.picker
        started = clock()
        try:
            picked = site.plugin.pick(request, ScoredCandidates(candidates, totals))
            if not isinstance(picked, list):
                raise TypeError(f"returned {type(picked).__name__}, not a list of endpoints")
        except Exception:
            site.failed(request, "exception", "failed; the best score is picked instead", exc_info=True)
            picked = [candidates[max(range(count), key=totals.__getitem__)]]
        site.observe(clock() - started)
        return picked

    # -- request lifecycle ---------------------------------------------------------------------

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        clock = time.perf_counter
        for site in self._pre_request:
            started = clock()
            try:
                site.plugin.pre_request(request, result)
            except Exception:
                site.failed(request, "exception", "raised", exc_info=True)
            site.observe(clock() - started)

    def response_received(
        self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]
    ) -> dict[str, str] | None:
        """Run the hooks; the response headers they ask to set (None: none)."""
        added: dict[str, str] | None = None
        clock = time.perf_counter
        for site in self._received:
            started = clock()
            try:
                extra = site.plugin.response_received(request, endpoint, headers)
                if extra:
                    added = {**added, **extra} if added else dict(extra)
            except Exception:
                site.failed(request, "exception", "raised", exc_info=True)
            site.observe(clock() - started)
        return added

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None:
        clock = time.perf_counter
        for site in self._complete:
            started = clock()
            try:
                site.plugin.response_complete(request, endpoint, outcome)
            except Exception:
                site.failed(request, "exception", "raised", exc_info=True)
            site.observe(clock() - started)
