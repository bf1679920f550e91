"""The scheduling framework: the public plugin API, and the runner that drives it.

Design
------
A request's trip through the framework, in order:

1. **Data producers** (:class:`DataProducer`) run once per request over the candidates and put what
   they compute into ``request.state`` under the data names they declare in ``produces``
   (``approx-prefix-cache-producer`` puts each candidate's prefix match there).
2. **The profile handler** (:class:`ProfileHandler`) chooses which scheduling profiles to run,
   possibly in several rounds (a prefill/decode handler runs two), and finally says which profile's
   result is the one the request goes to (``single-profile-handler``: the only one).
3. **Each profile** (:class:`Profile`) runs its filters in order (each narrows the candidates),
   then its scorers: every scorer gives each remaining candidate a score in [0, 1]; the runner
   clamps it (NaN counts as 0: a buggy scorer must not win), multiplies it by the scorer's weight
   and sums. The profile's picker turns the scored candidates into the endpoints to try, primary
   first, then fallbacks.
4. **Request-lifecycle hooks**, on every configured plugin that has them: ``pre_request`` after
   the pick, before the request leaves (the prefix index records the pick here, so a burst of one
   prefix sticks); ``response_received`` on the response headers; ``response_complete`` exactly
   once when the response ends, fails or the client goes away.

The per-request state object is the request itself: :class:`epp.extproc.parsing.InferenceRequest` carries
``state``, a dict that lives from parsing to ``response_complete``.

Plugins are plain objects with a ``name`` and any of the methods below; a plugin may take several
roles (``session-affinity-scorer`` is a scorer that also sets a response header). Roles are found by method, once,
at configuration time. New capabilities arrive as new optional methods, never as new required
ones, so an existing plugin keeps working. Data dependencies are declared, not discovered:
``produces``/``consumes`` (tuples of data names) let the configuration check, at startup, that
everything a plugin consumes is produced by a configured plugin, and order producers so that one
producer may consume another's output.

The runner times every plugin call (``observe``, see :class:`Scheduler`) and is pure, synchronous
CPU work over immutable endpoint snapshots; anything that waits lives in :mod:`epp.requestcontrol.director`.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from epp.datalayer.datastore import Endpoint
from epp.extproc.parsing import InferenceRequest

__all__ = [
    "DataProducer",
    "Filter",
    "Picker",
    "PreRequest",
    "Profile",
    "ProfileHandler",
    "ResponseComplete",
    "ResponseReceived",
    "ScoredCandidates",
    "ScoredEndpoint",
    "Scheduler",
    "SchedulingResult",
    "Scorer",
    "SingleProfileHandler",
    "WeightedScorer",
    "roles",
]


@dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    endpoint: Endpoint
    score: float


class ScoredCandidates(Sequence[ScoredEndpoint]):
    """What a picker receives: a sequence of :class:`ScoredEndpoint`, in candidate order.

    The items are made on demand; a picker that cares about speed reads the two parallel lists
    ``endpoints`` and ``scores`` instead (:meth:`columns` gives them for any sequence), which
    spares building one object per candidate per request.
    """

    __slots__ = ("endpoints", "scores")

    def __init__(self, endpoints: Sequence[Endpoint], scores: Sequence[float]) -> None:
        self.endpoints = endpoints
        self.scores = scores

    @staticmethod
    def columns(scored: Sequence[ScoredEndpoint]) -> tuple[Sequence[Endpoint], Sequence[float]]:
        """(endpoints, scores) of any sequence of scored endpoints."""
        if isinstance(scored, ScoredCandidates):
            return scored.endpoints, scored.scores
        return [item.endpoint for item in scored], [item.score for item in scored]

    def __len__(self) -> int:
        return len(self.endpoints)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [ScoredEndpoint(e, s) for e, s in zip(self.endpoints[index], self.scores[index])]
        return ScoredEndpoint(self.endpoints[index], self.scores[index])

    def __iter__(self) -> Iterator[ScoredEndpoint]:
        return map(ScoredEndpoint, self.endpoints, self.scores)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"ScoredCandidates({list(self)!r})"


# --- the plugin API ----------------------------------------------------------------------------


@runtime_checkable
class DataProducer(Protocol):
    """Computes per-request data before scheduling and stores it in ``request.state``.

    Declare the names stored in ``produces`` (and, if it reads another producer's data, ``consumes``).
    """

    name: str

    def produce(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> None: ...


@runtime_checkable
class Filter(Protocol):
    """Narrows the candidates; returning an empty list means no endpoint can take the request."""

    name: str

    def filter(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[Endpoint]: ...


@runtime_checkable
class Scorer(Protocol):
    """Scores every candidate in [0, 1] (higher is better); one score per candidate, in order."""

    name: str

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the endpoints to try, primary first, from the scored candidates."""

    name: str

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]: ...


# (``scored`` is a :class:`ScoredCandidates`: ``ScoredCandidates.columns(scored)`` is the fast way in.)


@runtime_checkable
class ProfileHandler(Protocol):
    """Chooses the profiles to run and which result the request goes to.

    ``pick_profiles`` is called until it returns no profile; each call sees the results so far
    (profile name -> endpoints; empty when the profile found none). ``process_results`` then names
    the primary profile; its endpoints are where the request goes.
    """

    name: str

    def pick_profiles(
        self, request: InferenceRequest, profiles: Mapping[str, Profile], results: Mapping[str, list[Endpoint]]
    ) -> Sequence[Profile]: ...

    def process_results(self, request: InferenceRequest, results: Mapping[str, list[Endpoint]]) -> str: ...


@runtime_checkable
class PreRequest(Protocol):
    """Called after the pick, before the request is sent to ``result.endpoints[0]``."""

    name: str

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None: ...


@runtime_checkable
class ResponseReceived(Protocol):
    """Called when the response headers arrive from ``endpoint``.

    May return headers to set on the response the client receives (``session-affinity-scorer``
    hands the client its session token this way); None adds nothing.
    """

    name: str

    def response_received(
        self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]
    ) -> Mapping[str, str] | None: ...


@runtime_checkable
class ResponseComplete(Protocol):
    """Called exactly once per routed request when its response ends.

    ``outcome`` is ``complete`` (the response ended), ``error`` (it failed) or ``cancelled`` (the
    client or the gateway went away).
    """

    name: str

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint, outcome: str) -> None: ...


# The extension points, in the order a request meets them; also the ``extension_point`` label of
# the plugin duration metric.
_ROLES: tuple[tuple[str, type], ...] = (
    ("DataProducer", DataProducer),
    ("ProfileHandler", ProfileHandler),
    ("Filter", Filter),
    ("Scorer", Scorer),
    ("Picker", Picker),
    ("PreRequest", PreRequest),
    ("ResponseReceived", ResponseReceived),
    ("ResponseComplete", ResponseComplete),
)


def roles(plugin: object) -> list[str]:
    """The extension points ``plugin`` implements (by method), in request order."""
    return [role for role, protocol in _ROLES if isinstance(plugin, protocol)]


# --- profiles and the runner -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    picker: Picker
    filters: tuple[Filter, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """Every profile's endpoints (primary first), and which profile the request goes to."""

    profile_results: Mapping[str, list[Endpoint]]
    primary_profile: str

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.profile_results.get(self.primary_profile, [])


class SingleProfileHandler:
    """``single-profile-handler``: runs the configuration's one profile; its result is the answer."""

    def __init__(self, name: str = "single-profile-handler") -> None:
        self.name = name

    def pick_profiles(
        self, request: InferenceRequest, profiles: Mapping[str, Profile], results: Mapping[str, list[Endpoint]]
    ) -> Sequence[Profile]:
        if results:
            return ()
        if len(profiles) != 1:
            raise RuntimeError(f"{self.name}: needs exactly one scheduling profile, the config has {len(profiles)}")
        return tuple(profiles.values())

    def process_results(self, request: InferenceRequest, results: Mapping[str, list[Endpoint]]) -> str:
        return next(iter(results))


# ``observe(extension_point, plugin)`` -> a callable taking the call's duration in seconds; the
# service binds it to ``inference_extension_plugin_duration_seconds``.
Observer = Callable[[str, object], Callable[[float], None]]


def _no_observer(extension_point: str, plugin: object) -> Callable[[float], None]:
    return _ignore


def _ignore(seconds: float) -> None:
    pass


@dataclass(slots=True)
class _Timed:
    """A plugin with its duration observer bound once, at build time."""

    plugin: Any
    observe: Callable[[float], None]
    weight: float = 1.0


@dataclass(slots=True)
class _CompiledProfile:
    profile: Profile
    filters: list[_Timed] = field(default_factory=list)
    scorers: list[_Timed] = field(default_factory=list)
    picker: _Timed | None = None


def _accumulate(totals: list[float], scores: Sequence[float], weight: float) -> list[float]:
    """``totals + weight * clamp(scores)``: scores clamped to [0, 1], NaN counting as 0 (a buggy
    scorer must not win). Whole-list passes in C when every score is in range, the usual case."""
    if not scores:
        return totals
    total = sum(scores)
    if total == total and min(scores) >= 0.0 and max(scores) <= 1.0:  # no NaN, none out of range
        weighted = scores if weight == 1.0 else map(weight.__mul__, scores)
        return list(map(operator.add, totals, weighted))
    clamped = [0.0 if math.isnan(v) or v < 0.0 else 1.0 if v > 1.0 else v for v in scores]
    return [t + weight * v for t, v in zip(totals, clamped)]


class Scheduler:
    """Runs the configured producers, profile handler and profiles for one request.

    ``profiles`` keeps the configuration's order. ``handler`` defaults to
    :class:`SingleProfileHandler`. ``producers`` must already be in dependency order.
    ``hooks`` are every configured plugin having a lifecycle method (their roles are read here).
    """

    def __init__(
        self,
        profiles: Profile | Sequence[Profile],
        *,
        handler: ProfileHandler | None = None,
        producers: Sequence[DataProducer] = (),
        hooks: Sequence[object] = (),
        observe: Observer = _no_observer,
    ) -> None:
        if isinstance(profiles, Profile):
            profiles = (profiles,)
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.profiles: dict[str, Profile] = {p.name: p for p in profiles}
        self.handler: ProfileHandler = handler or SingleProfileHandler()
        self._handler_pick = observe("ProfileHandler", self.handler)
        self._producers = [_Timed(p, observe("DataProducer", p)) for p in producers]
        self._compiled = {p.name: self._compile(p, observe) for p in profiles}
        self._pre_request = [_Timed(h, observe("PreRequest", h)) for h in hooks if isinstance(h, PreRequest)]
        self._received = [_Timed(h, observe("ResponseReceived", h)) for h in hooks if isinstance(h, ResponseReceived)]
        self._complete = [_Timed(h, observe("ResponseComplete", h)) for h in hooks if isinstance(h, ResponseComplete)]
        # The common case, one profile with the built-in handler, skips the handler's rounds.
        self._single = (
            self._compiled[next(iter(self.profiles))]
            if len(self.profiles) == 1 and type(self.handler) is SingleProfileHandler
            else None
        )

    @property
    def profile(self) -> Profile:
        """The first (with a single-profile configuration: the only) profile."""
        return next(iter(self.profiles.values()))

    @staticmethod
    def _compile(profile: Profile, observe: Observer) -> _CompiledProfile:
        return _CompiledProfile(
            profile=profile,
            filters=[_Timed(f, observe("Filter", f)) for f in profile.filters],
            scorers=[_Timed(w.scorer, observe("Scorer", w.scorer), w.weight) for w in profile.scorers],
            picker=_Timed(profile.picker, observe("Picker", profile.picker)),
        )

    # -- scheduling ---------------------------------------------------------------------------

    def schedule(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        """The endpoints to try, primary first; empty when no candidate survives."""
        return self.run(request, candidates).endpoints

    def run(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> SchedulingResult:
        """Producers, then the profile handler's profiles; every profile's result."""
        clock = time.perf_counter
        for timed in self._producers:
            started = clock()
            timed.plugin.produce(request, candidates)
            timed.observe(clock() - started)
        single = self._single
        if single is not None:
            return SchedulingResult({single.profile.name: self._run_profile(single, request, candidates)}, single.profile.name)
        results: dict[str, list[Endpoint]] = {}
        handler = self.handler
        while True:
            started = clock()
            chosen = handler.pick_profiles(request, self.profiles, results)
            self._handler_pick(clock() - started)
            if not chosen:
                break
            for profile in chosen:
                if profile.name in results:
                    raise RuntimeError(f"profile handler {handler.name!r} picked profile {profile.name!r} twice")
                results[profile.name] = self._run_profile(self._compiled[profile.name], request, candidates)
        if not results:
            return SchedulingResult({}, "")
        return SchedulingResult(results, handler.process_results(request, results))

    def _run_profile(self, compiled: _CompiledProfile, request: InferenceRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        clock = time.perf_counter
        for timed in compiled.filters:
            if not candidates:
                return []
            started = clock()
            candidates = timed.plugin.filter(request, candidates)
            timed.observe(clock() - started)
        if not candidates:
            return []
        count = len(candidates)
        totals: list[float] = [0.0] * count
        for timed in compiled.scorers:
            started = clock()
            scores = timed.plugin.score(request, candidates)
            timed.observe(clock() - started)
            if len(scores) != count:
                raise RuntimeError(f"scorer {timed.plugin.name!r} returned {len(scores)} scores for {count} candidates")
            totals = _accumulate(totals, scores, timed.weight)
        picker = compiled.picker
        assert picker is not None
        started = clock()
        picked = picker.plugin.pick(request, ScoredCandidates(candidates, totals))
        picker.observe(clock() - started)
        return picked

    # -- request lifecycle ---------------------------------------------------------------------

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None:
        for timed in self._pre_request:
            started = time.perf_counter()
            timed.plugin.pre_request(request, result)
            timed.observe(time.perf_counter() - started)

    def response_received(
        self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]
    ) -> dict[str, str] | None:
        """Run the hooks; the response headers they ask to set (None: none)."""
        added: dict[str, str] | None = None
        for timed in self._received:
            started = time.perf_counter()
            extra = timed.plugin.response_received(request, endpoint, headers)
            timed.observe(time.perf_counter() - started)
            if extra:
                added = {**added, **extra} if added else dict(extra)
        return added

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint, outcome: str) -> None:
        for timed in self._complete:
            started = time.perf_counter()
            timed.plugin.response_complete(request, endpoint, outcome)
            timed.observe(time.perf_counter() - started)
