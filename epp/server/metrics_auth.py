"""``--metrics-endpoint-auth``: the metrics port (``/metrics``, and ``/debug/*`` when enabled) asks the API server.

Upstream's picker (default on) puts controller-runtime's authentication and authorization filter
in front of its metrics server; this is the same check: a request must carry
``Authorization: Bearer <token>``; the token goes to a TokenReview and its user to a
SubjectAccessReview for the request's path with verb ``get`` (:mod:`epp.kube.auth`). Answers:

* no bearer token: 401 with ``WWW-Authenticate: Bearer``; a token the API server rejects: 401;
* a user RBAC does not allow: 403;
* the API server cannot be asked (unreachable, too slow, an error status): 503 — never the metrics
  unauthenticated. One warning line says why, at most every 30 s.

Threads: the metrics server answers on its own threads (a WSGI server: scrapes never touch the
event loop), but the client with the process' credentials is kubernetes_asyncio's, bound to the
event loop. A cache miss hands the two reviews to that loop with ``run_coroutine_threadsafe`` and
waits at most ``timeout`` seconds (then 503). That was chosen over a second, synchronous HTTPS
client because it reuses the one client discovery has already configured: kubeconfig contexts,
client certificates, exec credential plugins and the in-cluster token re-read on rotation would
otherwise have to be re-implemented, and would differ in the ways that matter for security.

The cache spares the API server: a decision is kept per (token, path) for 10 s when allowed and
2 s when refused (upstream's filter caches too; a scrape every few seconds thus costs two API
calls every 10 s per scraper), at most ``max_entries`` entries (least recently used go first).
Keys are SHA-256 digests: no token is kept in memory. A 503 is never cached.

Static mode (``--endpoints``) has no API server to ask, so the check is off there; start-up says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from epp.kube.auth import Access, ReviewUnavailable, review_access

__all__ = ["MetricsAuth", "Refusal"]

log = logging.getLogger(__name__)

# (status line, extra headers, body): what the WSGI layer sends instead of the page.
Refusal = tuple[str, list[tuple[str, str]], bytes]
Review = Callable[[str, str], Awaitable[tuple[Access, str]]]

_UNAVAILABLE_LOG_INTERVAL = 30.0
_REFUSALS: dict[Access, Refusal] = {
    Access.UNAUTHENTICATED: (
        "401 Unauthorized",
        [("WWW-Authenticate", 'Bearer realm="epp-metrics"')],
        b"unauthorized: the bearer token was not accepted by the Kubernetes API server (TokenReview)\n",
    ),
    Access.FORBIDDEN: (
        "403 Forbidden",
        [],
        b"forbidden: the token's user may not get this path (SubjectAccessReview; RBAC nonResourceURLs)\n",
    ),
}
_NO_TOKEN: Refusal = (
    "401 Unauthorized",
    [("WWW-Authenticate", 'Bearer realm="epp-metrics"')],
    b"unauthorized: send Authorization: Bearer <a Kubernetes token> (--metrics-endpoint-auth is on)\n",
)


def _bearer(header: str | None) -> str:
    """The token of ``Bearer <token>`` (scheme case-insensitive, as RFC 6750); "" if none."""
    if not header:
        return ""
    scheme, _, token = header.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class MetricsAuth:
    """The check, callable from any thread: :meth:`refusal` is None when the request may be served."""

    def __init__(
        self,
        review: Review,
        loop: asyncio.AbstractEventLoop,
        *,
        timeout: float = 5.0,
        allow_ttl: float = 10.0,
        deny_ttl: float = 2.0,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._review = review
        self._loop = loop
        self._timeout = timeout
        self._ttl = {Access.ALLOWED: allow_ttl, Access.UNAUTHENTICATED: deny_ttl, Access.FORBIDDEN: deny_ttl}
        self._max = max_entries
        self._clock = clock
        self._cache: OrderedDict[tuple[bytes, str], tuple[float, Access]] = OrderedDict()
        self._lock = threading.Lock()
        self._logged_at = -_UNAVAILABLE_LOG_INTERVAL

    @classmethod
    def for_client(cls, client: Any, loop: asyncio.AbstractEventLoop, **options: Any) -> MetricsAuth:
        """The check asking through ``client`` (a kubernetes_asyncio ApiClient living on ``loop``)."""
        return cls(lambda token, path: review_access(client, token, path), loop, **options)

    def refusal(self, authorization: str | None, path: str) -> Refusal | None:
        token = _bearer(authorization)
        if not token:
            return _NO_TOKEN
        key = (hashlib.sha256(token.encode()).digest(), path)
        now = self._clock()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] > now:
                self._cache.move_to_end(key)
                return _REFUSALS.get(cached[1])
        try:
            access = self._ask(token, path)
        except ReviewUnavailable as exc:
            self._log_unavailable(str(exc))
            return (
                "503 Service Unavailable",
                [("Retry-After", "5")],
                b"unavailable: the Kubernetes API server could not check the token (--metrics-endpoint-auth)\n",
            )
        with self._lock:
            self._cache[key] = (self._clock() + self._ttl[access], access)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return _REFUSALS.get(access)

    def wsgi_guard(self, environ: dict[str, Any]) -> Refusal | None:
        """:meth:`refusal` for a WSGI request."""
        return self.refusal(environ.get("HTTP_AUTHORIZATION"), environ.get("PATH_INFO") or "")

    def _ask(self, token: str, path: str) -> Access:
        try:
            future = asyncio.run_coroutine_threadsafe(self._reviewed(token, path), self._loop)
        except RuntimeError as exc:  # the loop is closed: shutting down
            raise ReviewUnavailable("the picker is shutting down") from exc
        try:
            return future.result(self._timeout)
        except FutureTimeout:
            future.cancel()
            raise ReviewUnavailable(f"no answer from the API server within {self._timeout:g}s") from None
        except ReviewUnavailable:
            raise
        except Exception as exc:  # e.g. the client's credentials failing to refresh: still undecided, so 503
            raise ReviewUnavailable(f"the review failed: {type(exc).__name__}: {exc}") from exc

    async def _reviewed(self, token: str, path: str) -> Access:
        access, user = await self._review(token, path)
        log.debug("metrics endpoint auth: %s %s for user %r", path, access.value, user)
        return access

    def _log_unavailable(self, reason: str) -> None:
        now = self._clock()
        with self._lock:
            if now - self._logged_at < _UNAVAILABLE_LOG_INTERVAL:
                return
            self._logged_at = now
        log.warning("metrics endpoint auth: answering 503, %s", reason)
