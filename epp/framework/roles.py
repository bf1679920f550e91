"""The extension points: what a plugin may do, in the order a request meets them.

Design
------
0. **Data preparation** (:class:`PrepareData`), the only asynchronous role: ``await
   plugin.prepare_data(request)`` runs before admission and scheduling, for work that waits on I/O or
   runs on a thread pool (``precise-prefix-cache-producer`` tokenizes the prompt there, or asks the
   engine's ``/tokenize``), and leaves its result in ``request.state`` for its own ``produce``. It
   must bound its own time: the request waits for it. A failure is isolated like any other.
1. **Data producers** (:class:`DataProducer`) run once per request over the candidates and put what
   they compute into ``request.state`` under the keys they declare in ``produces``
   (``approx-prefix-cache-producer`` puts each candidate's prefix match there).
2. **The profile handler** (:class:`ProfileHandler`) chooses which scheduling profiles to run,
   possibly in several rounds (a prefill/decode handler runs two), and finally says which profile's
   result the request goes to. With one profile and no handler, that profile runs once.
3. **Each profile** (:class:`Profile`) runs its filters in order (each narrows the candidates),
   then its scorers: every scorer gives each remaining candidate a score in [0, 1]; the runner
   multiplies it by the scorer's weight and sums. The profile's picker turns the scored candidates
   into the endpoints to try, primary first, then fallbacks.
4. **Request-lifecycle hooks**, on every configured plugin that has them: ``pre_request`` after the
   pick, before the request leaves (the prefix index records the pick here, so a burst of one prefix
   sticks); ``response_received`` on the response headers; ``response_complete`` exactly once when
   the response ends, fails or the client goes away.

Plugins are plain objects with a ``name`` and any of the methods below; a plugin may take several
roles (``session-affinity-scorer`` is a scorer that also sets a response header). Roles are found by
method (:func:`roles`), once, at configuration time. New capabilities arrive as new optional methods
or attributes, never as new required ones, so an existing plugin keeps working.

Every call is isolated: a plugin that raises, or returns something malformed, is logged (rate
limited) and counted in ``epp_plugin_errors_total{extension_point,plugin_type,plugin_name}``, and the
request goes on as if that plugin had abstained: a failing producer stores nothing, a failing filter
passes its input through, a failing scorer (or one returning the wrong number of scores, or
non-numbers) scores 0 everywhere, a failing picker is replaced by the best score, a failing hook is
skipped while the other hooks still run. A plugin can never fail a request.

Optional attributes a plugin may declare (class attributes are the usual way):

``produces`` / ``consumes``
    the :class:`~epp.framework.StateKey` objects (or their names) it writes to / reads from
    ``request.state``. Startup checks that every consumed key is produced by some configured plugin,
    orders producers by what they consume, and refuses a cycle.
``data_consumed``
    on a producer, a method taking a ``frozenset`` of names: startup calls it once with the state-key
    names the other configured plugins declare in ``consumes``, so that a producer may put off what no
    other plugin reads during scheduling (``precise-prefix-cache-producer`` then stores a warm turn's
    token ids after the pick's answer instead of before the pick). A plugin that reads another's data
    without declaring it may find it missing.
``reads_body``
    True on a plugin that reads ``request.body`` (the request as received: ``precise-prefix-cache-producer``
    renders and tokenizes it), False on one that does not. With ``epp serve --workers N`` the request is
    parsed in a worker process and routed in another, and the body travels there only for a
    configuration with a plugin that reads it: a plugin that does not say is taken to read it (it gets the
    body; the cost is the copy), unless it is one of epp's own, which say when they do.
``producer_parameters``
    on a consumer: the parameters to build the default producer of its data with, when the config has
    no producer for it (upstream configs list ``prefix-cache-scorer`` alone, with the index's
    parameters).
``default_for``
    on a plugin type's factory (its class for ``Class.from_config``): what this type is the default of
    (:data:`DEFAULT_PICKER`, :data:`DEFAULT_SATURATION_DETECTOR`, or :func:`default_producer_of` a
    key). The registry records it; startup adds such a plugin where the config leaves the role empty.
    Two installed types claiming one default stop startup, naming both.
``single_profile``
    on a profile handler, True: it promises that with one profile it runs that profile once and routes
    by its result, so the runner may skip calling it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload, runtime_checkable

from epp.framework.endpoint import Endpoint
from epp.framework.request import InferenceRequest, Outcome, StateKey

__all__ = [
    "DEFAULT_PICKER",
    "DEFAULT_SATURATION_DETECTOR",
    "ROLES",
    "DataProducer",
    "Filter",
    "Picker",
    "PreRequest",
    "PrepareData",
    "Profile",
    "ProfileHandler",
    "ResponseComplete",
    "ResponseReceived",
    "SchedulingResult",
    "ScoredCandidates",
    "ScoredEndpoint",
    "Scorer",
    "WeightedScorer",
    "declared_keys",
    "default_producer_of",
    "reads_body",
    "roles",
]

# What a plugin type may declare itself the default of (``default_for``).
DEFAULT_PICKER = "picker"
DEFAULT_SATURATION_DETECTOR = "saturation-detector"


def default_producer_of(key: StateKey[Any] | str) -> str:
    """The ``default_for`` entry of a producer that serves ``key`` when no configured plugin produces it."""
    return f"producer:{key.name if isinstance(key, StateKey) else key}"


@dataclass(frozen=True, slots=True)
class ScoredEndpoint:
    """A candidate and its total score (the weighted sum of its profile's scorers)."""

    endpoint: Endpoint
    score: float


class ScoredCandidates(Sequence[ScoredEndpoint]):
    """What a picker receives: a sequence of :class:`ScoredEndpoint`, in candidate order.

    The items are made on demand; a picker that cares about speed reads the two parallel lists
    ``endpoints`` and ``scores`` instead (:meth:`columns` gives them for any sequence), which spares
    building one object per candidate per request.
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

    @overload
    def __getitem__(self, index: int) -> ScoredEndpoint: ...
    @overload
    def __getitem__(self, index: slice) -> list[ScoredEndpoint]: ...
    def __getitem__(self, index: int | slice) -> ScoredEndpoint | list[ScoredEndpoint]:
        if isinstance(index, slice):
            return [ScoredEndpoint(e, s) for e, s in zip(self.endpoints[index], self.scores[index], strict=True)]
        return ScoredEndpoint(self.endpoints[index], self.scores[index])

    def __iter__(self) -> Iterator[ScoredEndpoint]:
        return map(ScoredEndpoint, self.endpoints, self.scores)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]  # a mutable-looking sequence: not hashable, like a list

    def __repr__(self) -> str:
        return f"ScoredCandidates({list(self)!r})"


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """Every profile's endpoints (primary first), and which profile the request goes to."""

    profile_results: Mapping[str, list[Endpoint]]
    primary_profile: str

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.profile_results.get(self.primary_profile, [])


# --- the roles ----------------------------------------------------------------------------------


@runtime_checkable
class PrepareData(Protocol):
    """Prepares per-request data before admission, asynchronously (I/O, a thread pool).

    Called once per request that has a body, before admission and the scheduling cycle; what it
    computes goes into ``request.state`` for the plugin's synchronous ``produce``. It must bound its
    own time (the request waits for it) and should not raise: a failure is logged, counted, and the
    request goes on without it.
    """

    name: str

    async def prepare_data(self, request: InferenceRequest) -> None: ...


@runtime_checkable
class DataProducer(Protocol):
    """Computes per-request data before scheduling and stores it in ``request.state``.

    Declare the keys stored in ``produces`` (and, if it reads another producer's data, ``consumes``).
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
    """Scores every candidate in [0, 1] (higher is better); one score per candidate, in order.

    Scores outside [0, 1] are clamped and NaN counts as 0: a buggy scorer must not win.
    """

    name: str

    def score(self, request: InferenceRequest, candidates: Sequence[Endpoint]) -> Sequence[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the endpoints to try, primary first, from the scored candidates.

    ``scored`` is a :class:`ScoredCandidates`: ``ScoredCandidates.columns(scored)`` is the fast way in.
    """

    name: str

    def pick(self, request: InferenceRequest, scored: Sequence[ScoredEndpoint]) -> list[Endpoint]: ...


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    """A scorer in a profile, with the weight its scores are multiplied by."""

    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    """A scheduling profile: filters in order, weighted scorers, one picker."""

    name: str
    picker: Picker
    filters: tuple[Filter, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()


@runtime_checkable
class ProfileHandler(Protocol):
    """Chooses the profiles to run and which result the request goes to.

    ``pick_profiles`` is called until it returns no profile; each call sees the results so far
    (profile name -> endpoints; empty when the profile found none). ``process_results`` then names the
    primary profile; its endpoints are where the request goes.
    """

    name: str

    def pick_profiles(
        self, request: InferenceRequest, profiles: Mapping[str, Profile], results: Mapping[str, list[Endpoint]]
    ) -> Sequence[Profile]: ...

    def process_results(self, request: InferenceRequest, results: Mapping[str, list[Endpoint]]) -> str: ...


@runtime_checkable
class PreRequest(Protocol):
    """Called after the pick, for bookkeeping later picks read (what was sent where).

    Behind Envoy it runs once the pick's answer is written to Envoy, while the request goes to
    ``result.endpoints[0]`` (it need not wait for the hooks), and always before the picker's next
    pick; the request already counts in its endpoint's in-flight numbers (epp.requestcontrol.director).
    """

    name: str

    def pre_request(self, request: InferenceRequest, result: SchedulingResult) -> None: ...


@runtime_checkable
class ResponseReceived(Protocol):
    """Called when the response headers arrive from ``endpoint``.

    May return headers to set on the response the client receives (``session-affinity-scorer`` hands
    the client its session token this way); None adds nothing.
    """

    name: str

    def response_received(
        self, request: InferenceRequest, endpoint: Endpoint, headers: Mapping[str, str]
    ) -> Mapping[str, str] | None: ...


@runtime_checkable
class ResponseComplete(Protocol):
    """Called exactly once per routed request when its response ends (see :data:`Outcome`)."""

    name: str

    def response_complete(self, request: InferenceRequest, endpoint: Endpoint, outcome: Outcome) -> None: ...


# The extension points, in the order a request meets them; also the ``extension_point`` label of
# the plugin metrics.
ROLES: tuple[tuple[str, type], ...] = (
    ("PrepareData", PrepareData),
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
    return [role for role, protocol in ROLES if isinstance(plugin, protocol)]


def declared_keys(plugin: object, attribute: str) -> tuple[str, ...]:
    """The state-key names in ``plugin``'s ``produces`` or ``consumes`` (keys or names, one or many)."""
    value = getattr(plugin, attribute, ())
    items = (value,) if isinstance(value, (str, StateKey)) else tuple(value)
    return tuple(item.name if isinstance(item, StateKey) else str(item) for item in items)


def reads_body(plugin: object) -> bool:
    """Whether ``plugin`` reads ``request.body`` (see ``reads_body`` in the module docstring): its
    declaration, else True, except for epp's own plugins (the ``plugins`` and ``epp`` packages), which
    declare it when they do."""
    declared = getattr(plugin, "reads_body", None)
    if isinstance(declared, bool):
        return declared
    return type(plugin).__module__.partition(".")[0] not in ("plugins", "epp")
