"""The plugin API of epp: the only package a plugin imports.

A scheduling plugin is a plain object with a ``name`` and the methods of the roles it takes
(:mod:`.roles`: producer, profile handler, filter, scorer, picker, lifecycle hooks), built by a
factory ``factory(name, parameters, handle)`` (:mod:`.handle`) that checks its parameters with the
helpers of :mod:`.parameters`. It reads immutable views: :class:`Endpoint` with its :class:`Metrics`
and in-flight counts (:mod:`.endpoint`), and :class:`InferenceRequest` with its per-request
:class:`RequestState` (:mod:`.request`). Plugins ship through the ``epp.plugins`` entry-point group;
the built-in plugins are written against exactly this package and registered the same way.

This package imports nothing of the rest of epp (a contract CI checks), and what it exports is the
compatibility surface: names are added, never removed or changed incompatibly. See docs/plugins.md.
"""

from epp.framework.data import PREFIX_MATCH, PrefixMatch
from epp.framework.endpoint import NEVER_SCRAPED, NO_IN_FLIGHT, Endpoint, InFlightView, Metrics
from epp.framework.handle import Handle, PluginMetrics, Pool, PoolListener, endpoint_in_flight
from epp.framework.helpers import CountedPicker, LogLimiter, lower_is_better, max_num_of_endpoints
from epp.framework.parameters import (
    Duration,
    bool_parameter,
    check_parameters,
    duration_parameter,
    float_parameter,
    format_duration,
    int_parameter,
    parse_duration,
    str_parameter,
)
from epp.framework.request import Api, InferenceRequest, Outcome, RequestState, StateKey
from epp.framework.roles import (
    DEFAULT_PICKER,
    DEFAULT_SATURATION_DETECTOR,
    ROLES,
    DataProducer,
    Filter,
    Picker,
    PrepareData,
    PreRequest,
    Profile,
    ProfileHandler,
    ResponseComplete,
    ResponseReceived,
    SchedulingResult,
    ScoredCandidates,
    ScoredEndpoint,
    Scorer,
    WeightedScorer,
    declared_keys,
    default_producer_of,
    roles,
)
from epp.framework.served import NOT_LISTED, ServedModels

__all__ = [
    "DEFAULT_PICKER",
    "DEFAULT_SATURATION_DETECTOR",
    "NEVER_SCRAPED",
    "NOT_LISTED",
    "NO_IN_FLIGHT",
    "PREFIX_MATCH",
    "ROLES",
    "Api",
    "CountedPicker",
    "DataProducer",
    "Duration",
    "Endpoint",
    "Filter",
    "Handle",
    "InFlightView",
    "InferenceRequest",
    "LogLimiter",
    "Metrics",
    "Outcome",
    "Picker",
    "PluginMetrics",
    "Pool",
    "PoolListener",
    "PreRequest",
    "PrefixMatch",
    "PrepareData",
    "Profile",
    "ProfileHandler",
    "RequestState",
    "ResponseComplete",
    "ResponseReceived",
    "SchedulingResult",
    "ScoredCandidates",
    "ScoredEndpoint",
    "Scorer",
    "ServedModels",
    "StateKey",
    "WeightedScorer",
    "bool_parameter",
    "check_parameters",
    "declared_keys",
    "default_producer_of",
    "duration_parameter",
    "endpoint_in_flight",
    "float_parameter",
    "format_duration",
    "int_parameter",
    "lower_is_better",
    "max_num_of_endpoints",
    "parse_duration",
    "roles",
    "str_parameter",
]
