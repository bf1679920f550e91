"""A Kubernetes API server in memory, speaking the real list and watch wire protocol over HTTP.

It exists so that discovery is tested with the real client library (kubernetes_asyncio) over real
sockets, including the failures a real API server produces. It serves namespaced resources -
Pods and InferencePools (``inference.networking.k8s.io/v1``) are registered - at their real paths::

    GET /api/v1/namespaces/{ns}/pods                                  list (PodList JSON)
    GET /api/v1/namespaces/{ns}/pods?watch=true&resourceVersion=N     watch (a chunked JSON stream)
    GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools[/{name}]

What it does as a real API server does:

* One resourceVersion counter for every write (as etcd's revision); a list answers with the
  collection's ``metadata.resourceVersion``; every object carries its own.
* ``labelSelector`` (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``) and
  ``fieldSelector`` (``metadata.name``, ``metadata.namespace``) on lists and watches;
  ``limit``/``continue`` pagination on lists.
* A watch replays the events after ``resourceVersion`` from its history, then streams new ones as
  ``{"type": ..., "object": ...}`` lines: ADDED, MODIFIED, DELETED, and with
  ``allowWatchBookmarks=true`` periodic BOOKMARKs that carry only the current resourceVersion.
  An object whose labels stop (start) matching the watch's selector arrives as DELETED (ADDED).
  Without ``resourceVersion`` (or with ``"0"``) the watch starts with an ADDED per existing object.
* A ``resourceVersion`` older than the retained history is answered with 410 Gone: by default as
  an ERROR event holding a ``Status`` (reason ``Expired``, code 410) followed by the end of the
  stream, as the watch cache does; with ``gone_as_http=True`` as an HTTP 410 with the Status body.
* ``timeoutSeconds`` ends a watch cleanly; errors answer with a ``Status`` JSON body
  (401 without the expected bearer token, 403 for a forbidden resource, 404 for a resource whose
  CRD is "not installed" or an unknown object).

Failure controls for tests: :meth:`compact` (forget history: resuming watches get 410),
:meth:`expire_watches` (send the 410 ERROR event to open watches), :meth:`drop_watches` (cut
open watch connections mid-stream, without the terminating chunk), :meth:`restart` (stop and
start on the same port; by default the history is lost, as a restarted API server's watch cache
is), :meth:`set_installed` and :meth:`forbid`. :attr:`requests` records every request.

Writes happen in-process (:meth:`apply`, :meth:`delete`, :meth:`terminate`, :meth:`set_ready`)
rather than over HTTP: the picker only reads, apart from the TokenReviews and SubjectAccessReviews
of ``--metrics-endpoint-auth``, answered as configured in :attr:`FakeApiServer.reviews`
(:mod:`epp.testing.fake_reviews`).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import ipaddress
import json
import re
import ssl
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from epp.testing.fake_reviews import AccessReviews

__all__ = [
    "INFERENCE_POOLS",
    "PODS",
    "FakeApiServer",
    "Resource",
    "make_pod",
    "make_pool",
    "make_tls",
    "write_kubeconfig",
]


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


PODS = Resource("", "v1", "pods", "Pod")
INFERENCE_POOLS = Resource("inference.networking.k8s.io", "v1", "inferencepools", "InferencePool")

_Key = tuple[Resource, str, str]  # (resource, namespace, name)


def _parse_bool(value: str | None) -> bool:
    """A boolean query parameter, read as Go's strconv.ParseBool does (kubernetes_asyncio sends "True")."""
    return value in ("1", "t", "T", "TRUE", "true", "True")


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: Mapping[str, str]

    @property
    def watch(self) -> bool:
        return _parse_bool(self.query.get("watch"))


@dataclass
class _Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    key: _Key
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Watcher:
    resource: Resource
    namespace: str | None
    matches: Callable[[Mapping[str, Any]], bool]
    bookmarks: bool
    queue: asyncio.Queue[_Event | str] = field(default_factory=asyncio.Queue)
    transport: Any = None


# --- selectors ---------------------------------------------------------------------------------------


def _split_requirements(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


_SET_REQUIREMENT = re.compile(r"^(\S+)\s+(in|notin)\s+\((.*)\)$")


_LabelTest = Callable[[Mapping[str, str]], bool]


def _value_in(key: str, values: set[str], negate: bool) -> _LabelTest:
    return lambda labels: (labels.get(key) in values) != negate


def _value_is(key: str, value: str, negate: bool) -> _LabelTest:
    return lambda labels: (labels.get(key) == value) != negate


def _has_key(key: str, negate: bool) -> _LabelTest:
    return lambda labels: (key in labels) != negate


def label_matcher(text: str) -> Callable[[Mapping[str, str]], bool]:
    """A predicate over a label map for a Kubernetes label selector; ValueError if malformed."""
    tests: list[_LabelTest] = []
    for requirement in _split_requirements(text):
        match = _SET_REQUIREMENT.match(requirement)
        if match:
            key, op, values = match.group(1), match.group(2), {v.strip() for v in match.group(3).split(",")}
            tests.append(_value_in(key, values, negate=op == "notin"))
        elif "!=" in requirement:
            key, _, value = requirement.partition("!=")
            tests.append(_value_is(key.strip(), value.strip(), negate=True))
        elif "=" in requirement:
            key, _, value = requirement.replace("==", "=", 1).partition("=")
            tests.append(_value_is(key.strip(), value.strip(), negate=False))
        elif requirement.startswith("!"):
            tests.append(_has_key(requirement[1:].strip(), negate=True))
        elif re.fullmatch(r"[\w./-]+", requirement):
            tests.append(_has_key(requirement, negate=False))
        else:
            raise ValueError(f"unable to parse requirement: {requirement!r}")
    return lambda labels: all(test(labels) for test in tests)


_FIELDS = {"metadata.name": ("metadata", "name"), "metadata.namespace": ("metadata", "namespace")}

_FieldTest = Callable[[Mapping[str, Any]], bool]


def _field_is(outer: str, inner: str, value: str, negate: bool) -> _FieldTest:
    return lambda obj: (obj.get(outer, {}).get(inner) == value) != negate


def field_matcher(text: str) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate over an object for a field selector on ``metadata.name``/``namespace``; ValueError otherwise."""
    tests: list[_FieldTest] = []
    for requirement in _split_requirements(text):
        negate = "!=" in requirement
        path, _, value = requirement.replace("!=", "=", 1).replace("==", "=", 1).partition("=")
        path = path.strip()
        if path not in _FIELDS:
            raise ValueError(f'field label not supported: "{path}"')
        outer, inner = _FIELDS[path]
        tests.append(_field_is(outer, inner, value.strip(), negate))
    return lambda obj: all(test(obj) for test in tests)


# --- helpers for tests -------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_pod(
    name: str,
    ip: str | None = "127.0.0.1",
    *,
    labels: Mapping[str, str] | None = None,
    ready: bool = True,
    annotations: Mapping[str, str] | None = None,
    namespace: str = "default",
    ports: Iterable[int] = (8000,),
) -> dict[str, Any]:
    """A Pod as the API serves it: running, with a Ready condition and (unless ``ip=None``) a pod IP."""
    status: dict[str, Any] = {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai", "ports": [{"containerPort": p} for p in ports]}
            ]
        },
        "status": status,
    }


def make_pool(
    name: str,
    selector: Mapping[str, str],
    ports: Iterable[int],
    *,
    namespace: str = "default",
    epp_service: str = "epp",
) -> dict[str, Any]:
    """An InferencePool v1."""
    return {
        "apiVersion": INFERENCE_POOLS.api_version,
        "kind": INFERENCE_POOLS.kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": epp_service, "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    }


def write_kubeconfig(path: str | Path, server: str, *, token: str | None = None, namespace: str = "default") -> Path:
    """A kubeconfig with one cluster/user/context pointing at ``server``."""
    user: dict[str, Any] = {"token": token} if token else {}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake", "user": user}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
        "current-context": "fake",
    }
    path = Path(path)
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def make_tls(directory: str | Path, host: str = "127.0.0.1") -> tuple[ssl.SSLContext, Path]:
    """A self-signed serving certificate for ``host`` (an IP SAN, as an API server's): the server's
    SSL context, and the certificate's path to trust (what a pod finds in ``ca.crt``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-apiserver")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory = Path(directory)
    cert_path, key_path = directory / "apiserver.crt", directory / "apiserver.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    return context, cert_path


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _error(code: int, reason: str, message: str) -> web.Response:
    return web.json_response(_status(code, reason, message), status=code)


# --- the server --------------------------------------------------------------------------------------


class FakeApiServer:
    """See the module docstring. ``async with FakeApiServer() as api: ...``"""

    def __init__(
        self,
        resources: Iterable[Resource] = (PODS, INFERENCE_POOLS),
        *,
        token: str | None = None,
        history: int = 1000,
        bookmark_interval: float = 0.5,
        gone_as_http: bool = False,
        host: str = "127.0.0.1",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.resources = {(r.group, r.version, r.plural): r for r in resources}
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.gone_as_http = gone_as_http
        self.host = host
        self.ssl_context = ssl_context
        self.port = 0
        self.requests: list[RecordedRequest] = []
        self._objects: dict[_Key, dict[str, Any]] = {}
        self._rv = 100  # an arbitrary start, so resourceVersions never look like list indexes
        self._history: deque[_Event] = deque(maxlen=history)
        self._history_floor = self._rv  # resuming from an RV below this answers 410
        self._watchers: set[_Watcher] = set()
        self._installed = set(self.resources.values())
        self._forbidden: set[Resource] = set()
        self._runner: web.AppRunner | None = None
        self.reviews = AccessReviews()  # TokenReview and SubjectAccessReview: which tokens, which grants

    # -- lifecycle --

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/version", self._version)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, ssl_context=self.ssl_context)
        await site.start()
        if not self.port:
            self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop serving: every open watch ends (its connection is closed)."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait("close")
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def restart(self, *, keep_history: bool = False) -> None:
        """Stop, then serve again on the same port with the same objects; the watch history is lost
        unless ``keep_history`` (clients resuming from an older resourceVersion get 410)."""
        await self.stop()
        if not keep_history:
            self.compact()
        await self.start()

    async def __aenter__(self) -> FakeApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        return write_kubeconfig(path, self.url, token=self.token, namespace=namespace)

    # -- state --

    @property
    def resource_version(self) -> int:
        return self._rv

    def get(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        obj = self._objects.get((resource, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def apply(self, obj: Mapping[str, Any], resource: Resource | None = None) -> dict[str, Any]:
        """Create or replace an object (its kind picks the resource); emits ADDED or MODIFIED."""
        resource = resource or self._resource_of(obj)
        new = copy.deepcopy(dict(obj))
        new.setdefault("apiVersion", resource.api_version)
        new.setdefault("kind", resource.kind)
        metadata = new.setdefault("metadata", {})
        namespace = metadata.setdefault("namespace", "default")
        key = (resource, namespace, metadata["name"])
        old = self._objects.get(key)
        self._rv += 1
        if old is None:
            metadata["uid"] = str(uuid.uuid4())
            metadata["creationTimestamp"] = _now()
            metadata["generation"] = 1
        else:
            metadata["uid"] = old["metadata"]["uid"]
            metadata["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            changed_spec = old.get("spec") != new.get("spec")
            metadata["generation"] = old["metadata"].get("generation", 1) + (1 if changed_spec else 0)
        metadata["resourceVersion"] = str(self._rv)
        self._objects[key] = new
        self._emit(_Event(self._rv, "ADDED" if old is None else "MODIFIED", key, old, new))
        return copy.deepcopy(new)

    def update(
        self, resource: Resource, namespace: str, name: str, change: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Apply ``change`` to a copy of the stored object and write it back (MODIFIED)."""
        current = self.get(resource, namespace, name)
        if current is None:
            raise KeyError(f"{resource.plural} {namespace}/{name} does not exist")
        change(current)
        return self.apply(current, resource)

    def delete(self, resource: Resource, namespace: str, name: str) -> None:
        """Remove an object at once; emits DELETED with its last state."""
        key = (resource, namespace, name)
        old = self._objects.pop(key)
        self._rv += 1
        final = copy.deepcopy(old)
        final["metadata"]["resourceVersion"] = str(self._rv)
        self._emit(_Event(self._rv, "DELETED", key, old, final))

    def terminate(self, namespace: str, pod: str, grace_seconds: int = 30) -> dict[str, Any]:
        """Start a Pod's graceful deletion: ``deletionTimestamp`` is set (MODIFIED), the Pod stays."""

        def change(obj: dict[str, Any]) -> None:
            obj["metadata"]["deletionTimestamp"] = _now()
            obj["metadata"]["deletionGracePeriodSeconds"] = grace_seconds

        return self.update(PODS, namespace, pod, change)

    def set_ready(self, namespace: str, pod: str, ready: bool) -> dict[str, Any]:
        """Flip a Pod's Ready (and ContainersReady) condition, as the kubelet does after a probe."""

        def change(obj: dict[str, Any]) -> None:
            for condition in obj["status"]["conditions"]:
                if condition["type"] in ("Ready", "ContainersReady"):
                    condition["status"] = "True" if ready else "False"

        return self.update(PODS, namespace, pod, change)

    def compact(self) -> None:
        """Forget the event history: a watch resuming from any earlier resourceVersion gets 410."""
        self._history.clear()
        self._history_floor = self._rv

    def expire_watches(self) -> int:
        """Send every open watch the 410 ERROR event (its resourceVersion has been compacted) and end it."""
        self.compact()
        for watcher in self._watchers:
            watcher.queue.put_nowait("expire")
        return len(self._watchers)

    def drop_watches(self) -> int:
        """Cut every open watch connection abruptly (no terminating chunk): a network failure."""
        count = 0
        for watcher in list(self._watchers):
            if watcher.transport is not None:
                watcher.transport.abort() if hasattr(watcher.transport, "abort") else watcher.transport.close()
                count += 1
            watcher.queue.put_nowait("close")
        return count

    def send_bookmarks(self) -> None:
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait("bookmark")

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def set_installed(self, resource: Resource, installed: bool) -> None:
        """Whether ``resource`` is served at all (a CRD that is not installed answers 404)."""
        (self._installed.add if installed else self._installed.discard)(resource)

    def forbid(self, resource: Resource, forbidden: bool = True) -> None:
        """Answer 403 for ``resource`` (missing RBAC)."""
        (self._forbidden.add if forbidden else self._forbidden.discard)(resource)

    def watch_requests(self, resource: Resource | None = None) -> list[RecordedRequest]:
        return [r for r in self.requests if r.watch and (resource is None or f"/{resource.plural}" in r.path)]

    def list_requests(self, resource: Resource | None = None) -> list[RecordedRequest]:
        return [r for r in self.requests if not r.watch and (resource is None or f"/{resource.plural}" in r.path)]

    def _resource_of(self, obj: Mapping[str, Any]) -> Resource:
        for resource in self.resources.values():
            if resource.kind == obj.get("kind"):
                return resource
        raise ValueError(f"no resource registered for kind {obj.get('kind')!r}")

    def _emit(self, event: _Event) -> None:
        self._history.append(event)
        if len(self._history) == self._history.maxlen:
            self._history_floor = max(self._history_floor, self._history[0].rv - 1)
        for watcher in self._watchers:
            if watcher.resource is event.key[0] and watcher.namespace in (None, event.key[1]):
                watcher.queue.put_nowait(event)

    # -- HTTP --

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "linux/amd64"})

    def _route(self, path: str) -> tuple[tuple[str, str, str], str | None, str | None] | None:
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        else:
            namespace = None
        if len(rest) == 1:
            return (group, version, rest[0]), namespace, None
        if len(rest) == 2:
            return (group, version, rest[0]), namespace, rest[1]
        return None

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(RecordedRequest(request.method, request.path, query))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "Unauthorized", "Unauthorized")
        review = await self.reviews.answer(request)
        if review is not None:
            return review
        route = self._route(request.path)
        if route is None:
            return _error(404, "NotFound", f"the server could not find the requested resource ({request.path})")
        gvr, namespace, name = route
        resource = self.resources.get(gvr)
        if resource is None or resource not in self._installed:
            return _error(404, "NotFound", "the server could not find the requested resource")
        if request.method != "GET":
            return _error(405, "MethodNotAllowed", f"{request.method} is not supported by this fake")
        if resource in self._forbidden:
            who = "system:serviceaccount:default:epp"
            return _error(
                403,
                "Forbidden",
                f'{resource.plural}{"." + resource.group if resource.group else ""} is forbidden: User "{who}" '
                f'cannot {"watch" if query.get("watch") else "list"} resource "{resource.plural}" in API group '
                f'"{resource.group}" in the namespace "{namespace}"',
            )
        if name is not None:
            obj = self._objects.get((resource, namespace or "", name))
            if obj is None:
                return _error(404, "NotFound", f'{resource.plural} "{name}" not found')
            return web.json_response(obj)
        try:
            labels = label_matcher(query.get("labelSelector", ""))
            fields = field_matcher(query.get("fieldSelector", ""))
        except ValueError as exc:
            return _error(400, "BadRequest", str(exc))

        def matches(obj: Mapping[str, Any]) -> bool:
            return labels(obj.get("metadata", {}).get("labels") or {}) and fields(obj)

        if _parse_bool(query.get("watch")):
            return await self._watch(request, resource, namespace, matches, query)
        return self._list(resource, namespace, matches, query)

    def _list(
        self,
        resource: Resource,
        namespace: str | None,
        matches: Callable[[Mapping[str, Any]], bool],
        query: Mapping[str, str],
    ) -> web.Response:
        items = sorted(
            (
                obj
                for (res, ns, _), obj in self._objects.items()
                if res is resource and namespace in (None, ns) and matches(obj)
            ),
            key=lambda obj: (obj["metadata"]["namespace"], obj["metadata"]["name"]),
        )
        rv = self._rv
        start = 0
        if query.get("continue"):
            try:
                token = json.loads(base64.urlsafe_b64decode(query["continue"]))
                start, rv = int(token["start"]), int(token["rv"])
            except (ValueError, KeyError, TypeError):
                return _error(400, "BadRequest", "invalid continue token")
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        limit = int(query.get("limit", "0") or 0)
        if limit > 0 and start + limit < len(items):
            token = json.dumps({"start": start + limit, "rv": rv}).encode()
            metadata["continue"] = base64.urlsafe_b64encode(token).decode()
            items = items[start : start + limit]
        else:
            items = items[start:]
        if not resource.group:  # built-in types: list items carry no apiVersion/kind
            items = [{k: v for k, v in item.items() if k not in ("apiVersion", "kind")} for item in items]
        return web.json_response(
            {"kind": f"{resource.kind}List", "apiVersion": resource.api_version, "metadata": metadata, "items": items}
        )

    async def _watch(
        self,
        request: web.Request,
        resource: Resource,
        namespace: str | None,
        matches: Callable[[Mapping[str, Any]], bool],
        query: Mapping[str, str],
    ) -> web.StreamResponse:
        rv_text = query.get("resourceVersion", "")
        try:
            since = int(rv_text) if rv_text not in ("", "0") else None
        except ValueError:
            return _error(400, "BadRequest", f"invalid resource version {rv_text!r}")
        gone = since is not None and since < self._history_floor
        if gone and self.gone_as_http:
            return _error(410, "Expired", f"too old resource version: {since} ({self._history_floor + 1})")
        watcher = _Watcher(resource, namespace, matches, _parse_bool(query.get("allowWatchBookmarks")))
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        watcher.transport = request.transport
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None

        async def send(kind: str, obj: Mapping[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        async def send_gone() -> None:
            await send(
                "ERROR", _status(410, "Expired", f"too old resource version: {since} ({self._history_floor + 1})")
            )

        try:
            if gone:
                await send_gone()
                return response
            self._watchers.add(watcher)
            if since is None:  # "get state and start at most recent": synthetic ADDED events
                for (res, ns, _), obj in sorted(self._objects.items(), key=lambda item: item[0][1:]):
                    if res is resource and namespace in (None, ns) and matches(obj):
                        await send("ADDED", obj)
            else:
                for event in list(self._history):
                    if event.rv > since and event.key[0] is resource and namespace in (None, event.key[1]):
                        await self._send_event(send, watcher, event)
            deadline = asyncio.get_running_loop().time() + timeout if timeout else None
            while True:
                wait = self.bookmark_interval if watcher.bookmarks else None
                if deadline is not None:
                    left = deadline - asyncio.get_running_loop().time()
                    if left <= 0:
                        break
                    wait = left if wait is None else min(wait, left)
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    item = "bookmark" if watcher.bookmarks else "tick"
                if item == "close":
                    return response
                if item == "expire":
                    await send_gone()
                    break
                if item == "bookmark":
                    if watcher.bookmarks:
                        await send(
                            "BOOKMARK",
                            {
                                "kind": resource.kind,
                                "apiVersion": resource.api_version,
                                "metadata": {"resourceVersion": str(self._rv)},
                            },
                        )
                    continue
                if isinstance(item, _Event):
                    await self._send_event(send, watcher, item)
            await response.write_eof()
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(watcher)
        return response

    async def _send_event(
        self, send: Callable[[str, Mapping[str, Any]], Any], watcher: _Watcher, event: _Event
    ) -> None:
        was = event.old is not None and event.type != "ADDED" and watcher.matches(event.old)
        now = watcher.matches(event.new)
        if event.type == "DELETED":
            if was:
                await send("DELETED", event.new)
        elif was and now:
            await send("MODIFIED", event.new)
        elif now:
            await send("ADDED", event.new)
        elif was:  # the object left the selector: the watch sees it go
            await send("DELETED", event.new)
