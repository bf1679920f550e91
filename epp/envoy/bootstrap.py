"""The one source of truth for the Envoy v3 bootstrap that puts Envoy in front of the picker.

`render(options)` builds the bootstrap as a plain dict (what tests and the launcher in
`epp.testing.envoy` use); `render_yaml(options)` is the same as YAML text. The files in
`deploy/envoy/` are generated from `DEPLOY_VARIANTS`, never edited by hand::

    python -m epp.envoy.bootstrap --write deploy/envoy   # regenerate
    python -m epp.envoy.bootstrap --check deploy/envoy   # exit 1 if a file is stale (CI)

Request path (it follows the Gateway API Inference Extension reference config)::

    client -> listener -> [1] early header mutation: drop a client-sent destination header
                          [2] ext_proc -> cluster "epp" (the picker, gRPC over HTTP/2)
                          [3] lua: keep only the first address of the picked list
                          [4] router
           route "picked"   (header present) -> "original_destination_cluster" (ORIGINAL_DST)
           route "unpicked" (header absent)  -> fail-open:   "pool_fallback" (static round robin)
                                                fail-closed: direct 503

Why each piece is there:

* [1] The destination header decides the upstream. A client could send it, and with a fail-open
  ext_proc and the picker down it would reach the router untouched (observed), so only the picker
  may set it. It is removed by the connection manager's early header mutation, which runs before
  route selection and before every HTTP filter. The `envoy.filters.http.header_mutation` filter
  (present in 1.40) removes the header too, but too late: Envoy had already matched and cached
  the route on the forged header (observed: forged header, picker answering without a pick ->
  ORIGINAL_DST with no header, 503 "no healthy upstream" instead of the "unpicked" route).
* [2] The picker answers the request headers only once it has the body (it needs the prompt), sets
  the header and asks Envoy to re-match the route. `route_cache_action: CLEAR` re-matches after
  every headers reply even if a picker forgets the clear bit: the route depends on that header.
  Trailer modes are SEND because FULL_DUPLEX_STREAMED body modes require it.
* [3] The picker lists fallbacks after the primary ("ip:port,ip:port"); see the verified facts.
* Route "unpicked" exists because ORIGINAL_DST with no usable header falls back to the downstream
  connection's own destination, i.e. Envoy itself when the listener restores the original
  destination. Requests without a picked endpoint never reach that cluster.
* The upstream clusters raise Envoy's default circuit breakers (1024 concurrent requests per
  cluster): every in-flight LLM stream holds one request on the pool cluster *and* one gRPC
  stream on "epp" for its whole duration, so the defaults would cap the gateway at 1024 streams.

Observed responses (`observe_responses`, `epp envoy-config --observe-responses`; our extension,
off by default: upstream's configurations and the gateways' process responses). The picker's filter
skips the response (header and trailer modes SKIP, body NONE), and a second ext_proc filter to the
same picker, in Envoy's observability mode ("send and go": it never waits for an answer and ignores
any), sends the picker the request's headers once routed, then the response's headers, each chunk
(STREAMED, the one body mode that mode sends) and its end. What it buys, measured side by side
(`python bench/streaming_cost.py --observe`, see epp/extproc/processor.py): no picker round trip on
the response's path (its headers and first chunk reach the client without waiting for the picker;
P50 added on a non-streamed request 0.52 against 0.62 ms in one run, level in two later ones: 0.62-0.63
against 0.62-0.66), less of the picker's CPU per streamed
chunk (it sends nothing, and reads observed connections in batches: 14.4 against 28.3 µs at one
stream, medians of four runs) and of Envoy's, and streams that outlive the picker: a picker killed
mid-stream cut the client's stream with processed responses (227 of 1,000 events arrived) and did
not with observed ones (all 1,000). What it costs:
plugins cannot set response headers (a `response_received` hook's headers are dropped, logged once),
and the picker cannot end a response. With `epp serve --workers N` the two streams of a request
often reach different workers; the observing worker claims the request through the owner process
(epp/requestcontrol/owner.py). Not for several picker replicas behind one Envoy cluster: a
request's streams may reach different replicas, and the one that routed it then finishes it 10 s
after the route, without its response's accounting (logged). Pinning the observer to the replica
that routed was tried with Envoy 1.40 and does not work: an ORIGINAL_DST observer cluster reading
the routing answer's dynamic metadata (`original_dst_lb_config.metadata_key`), or the filter state
`envoy.network.transport_socket.original_dst_address` set from it by `set_filter_state`, is not seen
by ext_proc's gRPC stream (`upstream_cx_none_healthy` for each of 10 streams; the filter state
redirected the request itself, 502). Verified against Envoy 1.40:

* The routing answer's dynamic metadata carries the picker's token for the request under namespace
  `epp` (the picker's filter lists it among its receiving namespaces, the observing filter among its
  forwarding ones): every message of the observing stream names the request it watches.
* With its response phase skipped, Envoy ends the picker's stream as soon as the routing answer is
  in (a reset, before the response starts), so the picker's stream carries gRPC metadata
  `x-epp-observed-responses: true` telling the picker to wait for the observer rather than finish
  the request there. The observer opens at once (its request headers, sent as the request
  goes on) and ends with the response: its last chunk (end_of_stream, often empty) or trailers;
  the picker then ends it. A response that never ends there (the client gone) is seen when Envoy
  closes the stream, `deferred_close_timeout` after the HTTP stream: the request is finished
  `cancelled` then. Measured (a client leaving a stream after its first event, 3 times each): with
  Envoy's default, 5 s, the request stayed counted in flight 5.00-5.01 s after the client left (0.01
  s processed); the observer sets it to 1 s (1.00 s measured; 0.2 s gave 0.21). Nothing a response
  sent is lost by closing sooner: the picker announces a stream window of 2^31-1, so Envoy has
  written every message before the close, and the picker reads them before the stream's end.
* Failure: the observer is `failure_mode_allow` (a picker away never fails a response it watches).
* The observer has a cluster of its own (`epp_observe`, the same picker): Envoy pools connections per
  cluster, so observed streams never share a connection with a request waiting for its route, and the
  picker may read such connections in batches, a few milliseconds late (epp/wire/_fast.c).


* `envoy.http.early_header_mutation.header_mutation`, `envoy.filters.http.header_mutation`,
  `envoy.filters.http.lua`, `envoy.filters.http.ext_proc` and
  `envoy.load_balancing_policies.override_host` are all compiled in (startup extension list).
* ext_proc `metadata_options` exists: `forwarding_namespaces.untyped` sends the stream's
  `envoy.lb.subset_hint` metadata to the picker; `receiving_namespaces.untyped` must list
  `envoy.lb`, otherwise the dynamic metadata the picker returns is dropped.
* ORIGINAL_DST with `use_http_header` parses the header as exactly one "ip:port". For
  "a:p,b:p" (with or without a space) it logs "invalid override header value", counts
  `original_dst_host_invalid` and answers 503 "no healthy upstream"; a missing header also gives
  503 here because the listener does not restore an original destination. Its optional
  `metadata_key` takes the first element of a *list* value but is equally strict with a
  comma-joined string, and a CEL `split()` is not available to header formatters. Hence the small
  Lua step [3] that keeps the first address; further addresses are ignored by Envoy. Checked end
  to end with a fake picker answering "b,a": b is hit, in BUFFERED and FULL_DUPLEX_STREAMED
  modes, bodies up to 2 MB.
* The native primary+fallback mechanism, the `override_host` load-balancing policy (header and
  `envoy.lb` metadata sources, comma lists, retries walk the list), only chooses among hosts the
  cluster already knows (STATIC/EDS); an unknown address silently goes to its fallback policy.
  ORIGINAL_DST rejects any policy but CLUSTER_PROVIDED ("LB policy ROUND_ROBIN is not valid for
  Cluster type ORIGINAL_DST"), so it cannot serve a pool Envoy does not know, which is the
  picker's case here.
* `route_cache_action: CLEAR` re-matches the route after a picker's headers reply that sets the
  header without `clear_route_cache`; with DEFAULT the same reply ends in the "unpicked" 503.
* With the picker down, fail-closed answers 500 from ext_proc. Fail-open continues without the
  header (route "unpicked", a pool member) only if ext_proc fails *before the first body chunk is
  handed to the picker*: in FULL_DUPLEX_STREAMED Envoy keeps no copy of the body (Envoy PR 41276).
  A refused connection is reported asynchronously, after the chunk of a POST has been sent, so with
  Envoy's default panic routing a down picker still turned every POST into a 500 (observed; GET
  and BUFFERED were fine). With `healthy_panic_threshold: 0` a cluster whose only picker failed its
  health check has no host, the gRPC stream fails synchronously and fail-open works for POSTs
  too (observed: `upstream_cx_none_healthy`, `failure_mode_allowed`, 200 from the pool). The health
  check alone leaves a window, though: it needs 2 failed checks at 1 s, and bench/chaos.py measured
  ~2 s of 500s after each SIGKILL of the picker (every POST sent meanwhile). So fail-open also ejects
  the picker on its first *local-origin* failure (a refused or reset connection: outlier detection
  with split local/external errors, nothing else enforced): the request that finds it dead is lost,
  the next ones go round it (observed: 0-1 lost beyond those in flight, against ~60 at 30 requests/s).
  The health check lifts the ejection once the picker answers again; Envoy 1.40 does so one check
  after the one that finds it healthy, so a restarted picker gets traffic ~1 s later than without
  ejection (those requests take the fail-open route: served, round robin). Fail-closed is left
  without it: a dead picker fails every request either way, and the ejection would only add that
  second of 500s after a restart.
* Envoy's own local replies sent before a route is chosen (426 for HTTP/1.0, 431 for more than 100
  headers or 60 KB of them) run through the encoder filters, ext_proc's response phase included:
  ext_proc opens a picker stream for the reply and waits, and the connection, closed at once after
  a codec error, goes away first; the client saw its connection closed with no answer (a 500 with
  the picker down and fail-closed). So ext_proc is `disabled` in the filter chain and turned on by
  per-route settings of the virtual host (an `ExtProcPerRoute` with empty overrides): a request
  that has a route goes through the picker exactly as before, and a reply without one does not
  (observed: 426 and 431 reach the client, picker up or down, fail-open or closed).
* The price of no panic routing: the picker must answer SERVING on the standard gRPC health
  service for `envoy.service.ext_proc.v3.ExternalProcessor` (as the upstream picker does). A
  picker that is up but NOT_SERVING (starting, draining) gets no traffic: fail-closed answers 500,
  fail-open uses the pool. Envoy's startup waits for the first health check round, not for
  success; once the picker answers, the next check (1 s) brings it in.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DEPLOY_VARIANTS",
    "DESTINATION_HEADER",
    "EPP_CLUSTER",
    "FALLBACK_CLUSTER",
    "OBSERVED_HEADER",
    "OBSERVER_CLOSE",
    "OBSERVER_CLUSTER",
    "OBSERVE_NAMESPACE",
    "ORIGINAL_DST_CLUSTER",
    "PICKER_UNAVAILABLE_BODY",
    "BootstrapOptions",
    "main",
    "render",
    "render_round_robin",
    "render_yaml",
]

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# The reporting twin of the destination header; never trusted from a client either.
_SERVED_HEADER = "x-gateway-destination-endpoint-served"
EPP_CLUSTER = "epp"
OBSERVER_CLUSTER = "epp_observe"  # the picker again, for the observing filter's own connections
OBSERVER_CLOSE = "1s"  # the observing filter's deferred_close_timeout (see "Observed responses")
ORIGINAL_DST_CLUSTER = "original_destination_cluster"
FALLBACK_CLUSTER = "pool_fallback"
_EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
_OBSERVER_FILTER = "epp.observe_responses"  # the second ext_proc filter (observe_responses)
OBSERVE_NAMESPACE = "epp"
"""The dynamic metadata namespace of the picker's request token (``request``), for the observing filter."""
OBSERVED_HEADER = "x-epp-observed-responses"
"""gRPC metadata on the picker's streams when another filter observes the responses (observe_responses)."""
_BODY_MODES = ("NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED")
# Far above any realistic gateway concurrency: the picker and the model servers apply back-pressure.
_MAX_CONCURRENCY = 100_000
_TYPE = "@type"
_API = "type.googleapis.com/envoy"


@dataclass(frozen=True)
class BootstrapOptions:
    """Everything that varies between the Envoy configs we run; the rest is fixed by `render`."""

    listen_address: str = "0.0.0.0"
    listen_port: int = 8081
    admin_address: str = "127.0.0.1"
    admin_port: int = 9901
    picker_address: str = "127.0.0.1"
    """An IP literal (static cluster) or a DNS name (strict DNS cluster, e.g. a Service name)."""
    picker_port: int = 9002
    picker_tls: bool = False
    """TLS from Envoy to the picker. The picker serves a self-signed certificate by default, so the
    certificate is only verified when `picker_ca_file` is given."""
    picker_ca_file: str | None = None
    fail_open: bool = False
    """ext_proc `failure_mode_allow`: when the picker is unreachable, send the request to a member
    of `pool_endpoints` (round robin) instead of failing it."""
    pool_endpoints: tuple[str, ...] = ()
    """"ip:port" of the pool members, used only by the fail-open fallback route."""
    request_body_mode: str = "FULL_DUPLEX_STREAMED"
    response_body_mode: str = "FULL_DUPLEX_STREAMED"
    observe_responses: bool = False
    """Our extension (upstream's configurations process responses): the picker's ext_proc filter skips
    the response, and a second one, in Envoy's observability mode, sends the picker the response's
    headers, chunks and end without waiting for answers (see "Observed responses" above).
    `response_body_mode` is then unused."""

    def __post_init__(self) -> None:
        for name in ("listen_port", "admin_port", "picker_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        for name in ("request_body_mode", "response_body_mode"):
            if getattr(self, name) not in _BODY_MODES:
                raise ValueError(f"{name} must be one of {', '.join(_BODY_MODES)}")
        if self.picker_ca_file is not None and not self.picker_tls:
            raise ValueError("picker_ca_file is only used with picker_tls=True")
        if self.fail_open and not self.pool_endpoints:
            # Without a fallback pool the only place an unpicked request could go is Envoy itself.
            raise ValueError("fail_open=True needs pool_endpoints for the fallback route")
        for endpoint in self.pool_endpoints:
            _split_endpoint(endpoint)


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    """Parse "ip:port" or "[ipv6]:port"; a static cluster needs IP literals, not names."""
    host, _, port = endpoint.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    version: int  # 4 or 6; 0 for what is no IP literal
    try:
        version = ipaddress.ip_address(host).version
        port_number = int(port)
    except ValueError:
        version, port_number = 0, 0
    if version != (6 if bracketed else 4) or not 0 < port_number <= 65535:
        raise ValueError(f"pool endpoint {endpoint!r} is not of the form ip:port or [ipv6]:port")
    return host, port_number


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def _socket_address(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def _typed(name: str, type_name: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {_TYPE: f"{_API}.{type_name}", **config}}


def _protocol_options(http_version: dict[str, Any]) -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            _TYPE: f"{_API}.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": http_version,
        }
    }


def _circuit_breakers() -> dict[str, Any]:
    limits = ("max_connections", "max_pending_requests", "max_requests")
    return {"thresholds": [dict.fromkeys(limits, _MAX_CONCURRENCY)]}


# Runs after ext_proc: Envoy's ORIGINAL_DST parses exactly one "ip:port", while the picker may list
# fallbacks after the primary. Values without a comma are left alone (no header write).
_FIRST_ENDPOINT_LUA = f"""\
function envoy_on_request(handle)
  local headers = handle:headers()
  local value = headers:get("{DESTINATION_HEADER}")
  if value == nil then
    return
  end
  local comma = string.find(value, ",", 1, true)
  if comma ~= nil then
    local first = string.match(string.sub(value, 1, comma - 1), "^%s*(.-)%s*$")
    headers:replace("{DESTINATION_HEADER}", first)
  end
end
"""


def _strip_client_destination() -> dict[str, Any]:
    return _typed(
        "envoy.http.early_header_mutation.header_mutation",
        "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
        mutations=[{"remove": DESTINATION_HEADER}, {"remove": _SERVED_HEADER}],
    )


def _http_filters(options: BootstrapOptions) -> list[dict[str, Any]]:
    ext_proc = _typed(
        _EXT_PROC_FILTER,
        "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        # The upstream reference values for the gRPC timeout and the message timeout.
        grpc_service={"envoy_grpc": {"cluster_name": EPP_CLUSTER}, "timeout": "10s"},
        failure_mode_allow=options.fail_open,
        # Generous: the picker holds the headers reply until the whole body has arrived and may
        # queue the request before picking.
        message_timeout="1000s",
        processing_mode={
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": options.request_body_mode,
            "response_body_mode": options.response_body_mode,
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
        },
        route_cache_action="CLEAR",
        metadata_options={
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    )
    first_endpoint = _typed(
        "envoy.filters.http.lua",
        "extensions.filters.http.lua.v3.Lua",
        default_source_code={"inline_string": _FIRST_ENDPOINT_LUA},
        # Trimming the list never changes whether the header is present, so the route stands.
        clear_route_cache=False,
    )
    # Off unless the route turns it on (_ROUTED_BY_PICKER): a local reply Envoy sends before it has
    # a route (426 for HTTP/1.0, 431 for too many or too large headers) must not reach the picker's
    # response phase, where the reply was lost (see the module docstring).
    ext_proc["disabled"] = True
    router = _typed("envoy.filters.http.router", "extensions.filters.http.router.v3.Router")
    if not options.observe_responses:
        return [ext_proc, first_endpoint, router]
    picker = ext_proc["typed_config"]
    picker["processing_mode"].update(
        response_header_mode="SKIP", response_body_mode="NONE", response_trailer_mode="SKIP"
    )
    picker["metadata_options"]["receiving_namespaces"]["untyped"].append(OBSERVE_NAMESPACE)
    # Envoy ends this stream once the request is routed: the picker is told to wait for the observer.
    picker["grpc_service"]["initial_metadata"] = [{"key": OBSERVED_HEADER, "value": "true"}]
    observer = _typed(
        _OBSERVER_FILTER,
        "extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": OBSERVER_CLUSTER}, "timeout": "10s"},
        # A picker that is away (restarting, rolled) must never fail a response it only watches.
        failure_mode_allow=True,
        observability_mode=True,
        # How long after the HTTP stream Envoy closes this one: when a client leaves mid-response, how
        # long the picker counts the request in flight (Envoy's default: 5 s).
        deferred_close_timeout=OBSERVER_CLOSE,
        processing_mode={
            # The request's headers open the stream as soon as the request is routed, so that the
            # picker learns of a request that ends before its response starts (the client gone).
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "NONE",
            "response_body_mode": "STREAMED",  # (the one body mode observability mode sends)
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SEND",
        },
        # The picker's token for the request (set by its routing answer) names what is observed.
        metadata_options={"forwarding_namespaces": {"untyped": [OBSERVE_NAMESPACE]}},
    )
    observer["disabled"] = True  # on per route, as the picker's filter (local replies stay out of it)
    return [ext_proc, observer, first_endpoint, router]


# Per-route ext_proc settings that change nothing but turn the (default-off) filter on.
_PICKER_ON = {_TYPE: f"{_API}.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", "overrides": {}}


def _routes(options: BootstrapOptions) -> list[dict[str, Any]]:
    picked = {
        "name": "picked",
        "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
        # 0s disables the per-request timeout: a long generation may stream for many minutes.
        "route": {"cluster": ORIGINAL_DST_CLUSTER, "timeout": "0s"},
    }
    unpicked: dict[str, Any] = {"name": "unpicked", "match": {"prefix": "/"}}
    if options.fail_open:
        unpicked["route"] = {
            "cluster": FALLBACK_CLUSTER,
            "timeout": "0s",
            # Degraded mode already: skip a member that refuses connections instead of failing.
            "retry_policy": {"retry_on": "connect-failure,refused-stream", "num_retries": 2},
        }
    else:
        unpicked["direct_response"] = {
            "status": 503,
            "body": {"inline_string": "no endpoint was picked for this request\n"},
        }
    return [picked, unpicked]


def _ingress(
    options: BootstrapOptions,
    routes_name: str,
    routes: list[dict[str, Any]],
    vhost: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The HTTP listener: one connection manager with ``routes`` (in one virtual host, with ``vhost``'s
    settings) and ``extra`` settings (filters...)."""
    vhost = vhost or {}
    connection_manager = _typed(
        "envoy.filters.network.http_connection_manager",
        "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="ingress_http",
        codec_type="AUTO",
        # Envoy's default of 5 minutes can cut a stream that waits in a model server's queue.
        stream_idle_timeout="600s",
        route_config={
            "name": routes_name,
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes, **vhost}],
        },
        **extra,
    )
    return {
        "name": "ingress",
        "address": _socket_address(options.listen_address, options.listen_port),
        # Envoy's default (SO_REUSEPORT on Linux) lets a second Envoy bind the same port and take
        # half of its connections; without it the second one fails to start, naming the address.
        "enable_reuse_port": False,
        "filter_chains": [{"filters": [connection_manager]}],
    }


def _listener(options: BootstrapOptions) -> dict[str, Any]:
    on = {_EXT_PROC_FILTER: _PICKER_ON}
    if options.observe_responses:
        on[_OBSERVER_FILTER] = _PICKER_ON
    return _ingress(
        options,
        "epp_routes",
        _routes(options),
        # Every request that has a route goes through the picker.
        {"typed_per_filter_config": on},
        # Runs before route selection and before any HTTP filter; see the module docstring.
        early_header_mutation_extensions=[_strip_client_destination()],
        http_filters=_http_filters(options),
        local_reply_config=_picker_failure_reply(),
    )


# The body of ext_proc's own 500 when the picker cannot be asked (down, not SERVING, a TLS mismatch),
# OpenAI-style like the picker's own refusals; Envoy's is empty.
PICKER_UNAVAILABLE_BODY = (
    '{"error":{"message":"the endpoint picker could not be reached (down, not serving, or a TLS mismatch '
    'between Envoy and the picker)","type":"InternalServerError","code":500}}\n'
)


def _picker_failure_reply() -> dict[str, Any]:
    """A body for the local reply Envoy makes when the ext_proc call itself fails.

    Only those replies match (their response code details start with ``ext_proc``, e.g.
    ``ext_proc_error_gRPC_error_14{no_healthy_upstream}``): the picker's own immediate responses
    carry ``epp_<reason>`` details and keep their bodies.
    """
    cel = _typed(
        "envoy.access_loggers.extension_filters.cel",
        "extensions.access_loggers.filters.cel.v3.ExpressionFilter",
        expression="response.code_details.startsWith('ext_proc')",
    )
    return {
        "mappers": [
            {
                "filter": {"extension_filter": cel},
                "body": {"inline_string": PICKER_UNAVAILABLE_BODY},
                "body_format_override": {"text_format": "%LOCAL_REPLY_BODY%", "content_type": "application/json"},
            }
        ]
    }


def _epp_cluster(options: BootstrapOptions) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": EPP_CLUSTER,
        "type": "STATIC" if _is_ip(options.picker_address) else "STRICT_DNS",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": _protocol_options({"http2_protocol_options": {}}),
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": EPP_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": _socket_address(
                                    options.picker_address, options.picker_port
                                )
                            }
                        }
                    ]
                }
            ],
        },
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "1s",
                # Two misses in a row: one slow answer from a busy picker is no outage.
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                # Probe at the normal pace before the first request too, so the state is current.
                "no_traffic_interval": "1s",
                "grpc_health_check": {"service_name": _EXT_PROC_SERVICE},
            }
        ],
        # No panic routing: with every picker unhealthy, ext_proc must fail at once, before a body
        # chunk is sent, or fail-open cannot apply in FULL_DUPLEX_STREAMED (module docstring).
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
    }
    if options.fail_open:
        cluster["outlier_detection"] = _eject_on_connection_failure()
    if options.picker_tls:
        # gRPC servers refuse TLS connections that do not negotiate HTTP/2 through ALPN.
        common: dict[str, Any] = {"alpn_protocols": ["h2"]}
        if options.picker_ca_file is not None:
            common["validation_context"] = {"trusted_ca": {"filename": options.picker_ca_file}}
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                _TYPE: f"{_API}.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": common,
            },
        }
    return cluster


def _eject_on_connection_failure() -> dict[str, Any]:
    """Outlier detection that takes the picker out at its first refused or reset connection (fail-open:
    the requests after it go round a crashed picker at once; see the module docstring) and on nothing
    else: not on the picker's own error answers, not on success rates."""
    return {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_consecutive_5xx": 0,
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "enforcing_failure_percentage": 0,
        "enforcing_failure_percentage_local_origin": 0,
        # One picker is the usual deployment: ejecting it is the point (the default, 10%, would
        # still eject one host, but says the opposite).
        "max_ejection_percent": 100,
    }


def _original_dst_cluster() -> dict[str, Any]:
    return {
        "name": ORIGINAL_DST_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
        # A pod on the cluster network accepts in milliseconds; a longer wait only delays the 503.
        "connect_timeout": "5s",
        "typed_extension_protocol_options": _protocol_options({"http_protocol_options": {}}),
        "circuit_breakers": _circuit_breakers(),
    }


def _fallback_cluster(options: BootstrapOptions) -> dict[str, Any]:
    lb_endpoints = []
    for endpoint in options.pool_endpoints:
        host, port = _split_endpoint(endpoint)
        lb_endpoints.append({"endpoint": {"address": _socket_address(host, port)}})
    return {
        "name": FALLBACK_CLUSTER,
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "5s",
        "typed_extension_protocol_options": _protocol_options({"http_protocol_options": {}}),
        "circuit_breakers": _circuit_breakers(),
        "load_assignment": {
            "cluster_name": FALLBACK_CLUSTER,
            "endpoints": [{"lb_endpoints": lb_endpoints}],
        },
    }


def render(options: BootstrapOptions) -> dict[str, Any]:
    """Return the Envoy v3 bootstrap for `options` as a fresh, JSON/YAML-serialisable dict."""
    clusters = [_epp_cluster(options), _original_dst_cluster()]
    if options.observe_responses:
        # The same picker, other connections: on them every stream is observed, which the picker reads
        # in batches (epp/wire/_fast.c, set_observe_coalesce); a routed request's stream never waits there.
        observer = _epp_cluster(options)
        observer["name"] = observer["load_assignment"]["cluster_name"] = OBSERVER_CLUSTER
        clusters.append(observer)
    if options.fail_open:
        clusters.append(_fallback_cluster(options))
    return {
        "admin": {"address": _socket_address(options.admin_address, options.admin_port)},
        "static_resources": {"listeners": [_listener(options)], "clusters": clusters},
    }


def render_round_robin(options: BootstrapOptions) -> dict[str, Any]:
    """The same listener with no picker: Envoy alone, round robin over `pool_endpoints`.

    The baseline benchmarks compare against (what the gateway costs without ext_proc, and the
    routing quality of plain load balancing).
    """
    if not options.pool_endpoints:
        raise ValueError("render_round_robin needs pool_endpoints")
    listener = _ingress(
        options,
        "round_robin",
        [{"match": {"prefix": "/"}, "route": {"cluster": FALLBACK_CLUSTER, "timeout": "0s"}}],
        http_filters=[_typed("envoy.filters.http.router", "extensions.filters.http.router.v3.Router")],
    )
    return {
        "admin": {"address": _socket_address(options.admin_address, options.admin_port)},
        "static_resources": {"listeners": [listener], "clusters": [_fallback_cluster(options)]},
    }


def _describe(options: BootstrapOptions) -> str:
    if options.fail_open:
        failure = "fail-open (unpicked requests go round robin to the listed pool)"
    else:
        failure = "fail-closed (no pick, no request)"
    transport = "TLS" if options.picker_tls else "plaintext"
    return f"{failure}; {transport} to the picker at {options.picker_address}:{options.picker_port}"


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the Lua source) as readable literal blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def render_yaml(options: BootstrapOptions, *, header: str | None = None) -> str:
    """Return the bootstrap as YAML text, headed by a comment saying how it was generated.

    ``header``: that comment's first lines (default: the deploy files' "do not edit" note).
    """
    if header is None:
        header = (
            "# Generated by epp/envoy/bootstrap.py: do not edit by hand.\n"
            "# Regenerate with `python -m epp.envoy.bootstrap --write deploy/envoy`.\n"
        )
    header += f"# Variant: {_describe(options)}.\n"
    return header + yaml.dump(render(options), Dumper=_Dumper, sort_keys=False, width=100)


_EXAMPLE_POOL = ("10.0.0.1:8000", "10.0.0.2:8000")

DEPLOY_VARIANTS: dict[str, BootstrapOptions] = {
    "envoy.yaml": BootstrapOptions(),
    "envoy-failopen.yaml": BootstrapOptions(fail_open=True, pool_endpoints=_EXAMPLE_POOL),
    "envoy-tls.yaml": BootstrapOptions(picker_tls=True),
    "envoy-failopen-tls.yaml": BootstrapOptions(
        picker_tls=True, fail_open=True, pool_endpoints=_EXAMPLE_POOL
    ),
}
"""File name in deploy/envoy/ -> the options it is rendered from."""


def main(argv: Sequence[str] | None = None) -> int:
    """Write (`--write DIR`) or verify (`--check DIR`) the deploy files; 1 when a check fails."""
    parser = argparse.ArgumentParser(
        prog="python -m epp.envoy.bootstrap", description="Render the Envoy bootstrap files."
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="DIR", type=Path, help="(re)generate the files in DIR")
    action.add_argument(
        "--check", metavar="DIR", type=Path, help="exit 1 if a file in DIR is missing or stale"
    )
    args = parser.parse_args(argv)

    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, options in DEPLOY_VARIANTS.items():
            (args.write / name).write_text(render_yaml(options), encoding="utf-8")
        return 0

    stale = []
    for name, options in DEPLOY_VARIANTS.items():
        path: Path = args.check / name
        if not path.is_file() or path.read_text(encoding="utf-8") != render_yaml(options):
            stale.append(str(path))
    if stale:
        print(
            "out of date: " + ", ".join(stale) + "\n"
            f"run: python -m epp.envoy.bootstrap --write {args.check}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
