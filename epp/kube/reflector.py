"""List-then-watch of one Kubernetes collection, kept current through everything the API server does.

A :class:`Reflector` mirrors one collection (the Pods a selector matches, or the one InferencePool a
field selector names) in :attr:`Reflector.objects`, and calls ``on_change()`` after every change. It
follows client-go's reflector, reduced to what discovery needs:

1. **List** without a ``resourceVersion`` (a consistent read from etcd, not a possibly stale cache),
   replace the local copy wholesale and remember the list's ``resourceVersion``.
2. **Watch** from that ``resourceVersion`` with ``allowWatchBookmarks=true`` and a server-side
   ``timeoutSeconds`` drawn from 5-10 minutes (random, as client-go does, so that many pickers do not
   reconnect in step). ADDED/MODIFIED/DELETED update the copy; a BOOKMARK only advances the
   ``resourceVersion``, which keeps a quiet watch's position fresh so that resuming it rarely hits
   410. All the events that arrive in one network read are applied before ``on_change()`` runs once.
3. A watch that the server ends cleanly (its timeout) is **resumed** at once from the last
   ``resourceVersion``: no re-list.
4. **410 Gone** - an HTTP 410, or an ERROR event whose Status has code 410 - means the
   ``resourceVersion`` has been compacted away: **re-list** (1), immediately (after the backoff if
   no event arrived since the previous list, so a server that keeps answering 410 is not hammered).
5. A dropped connection (connection refused or reset, a stream cut mid-chunk, a read that times
   out) waits out the backoff and **resumes** the watch from its ``resourceVersion``. Any other error
   (a non-410 ERROR event, 401/403/404/5xx) waits and **re-lists**, as client-go does. The backoff
   doubles from 0.1 s to at most 30 s (with jitter) and starts over after a list succeeds or a watch
   delivers an event. A failure is logged as a WARNING when it is new; the same failure again (a
   CRD that is not installed answers 404 every 30 s for as long as the picker runs) is logged at
   DEBUG, and the recovery once, at INFO.

The client side of the HTTP is kubernetes_asyncio's (URL, query parameters, authentication, TLS, its
aiohttp session); the responses are read raw (``_preload_content=False``) and decoded here, so that
objects stay plain dicts, a watch line may be any size, and every failure is classified as above.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

__all__ = ["ApiError", "Backoff", "Gone", "ListCall", "Reflector"]

log = logging.getLogger(__name__)

# A kubernetes_asyncio list method with its positional arguments bound (functools.partial); called
# with query parameters as keyword arguments, it returns the raw aiohttp response.
ListCall = Callable[..., Awaitable[Any]]

# client-go's reflector: watches time out after minWatchTimeout (5 min) times a random 1..2.
WATCH_TIMEOUT_RANGE = (300.0, 600.0)
# How long a watch connection may stay silent beyond its server-side timeout before it is taken
# for dead. Bookmarks (about one a minute on a real API server) keep a live one talking.
_READ_GRACE_SECONDS = 30.0
_LIST_TIMEOUT_SECONDS = 60.0
_CONNECT_TIMEOUT_SECONDS = 10.0


class ApiError(Exception):
    """The API server refused a request; ``status`` is the HTTP status (or the ERROR event's code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class Gone(ApiError):
    """410: the resourceVersion is too old (compacted); only a new list can continue."""


class Backoff:
    """Exponential backoff with jitter, bounded: ``initial`` doubling up to ``maximum`` seconds."""

    def __init__(self, initial: float = 0.1, maximum: float = 30.0) -> None:
        if not 0 < initial <= maximum:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self.failures = 0

    def next(self) -> float:
        delay = min(self.maximum, self.initial * 2**self.failures)
        self.failures = min(self.failures + 1, 64)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


def _status_message(body: bytes, status: int) -> str:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:200].decode(errors="replace") or f"HTTP {status}"
    if isinstance(decoded, dict) and decoded.get("message"):
        return str(decoded["message"])
    return f"HTTP {status}"


async def _check(response: Any) -> None:
    if response.status != 200:
        body = await response.read()
        response.release()
        message = _status_message(body, response.status)
        raise (Gone if response.status == 410 else ApiError)(response.status, message)


class Reflector:
    """Mirror one collection; see the module docstring. ``await run()`` until cancelled."""

    def __init__(
        self,
        what: str,
        list_call: ListCall,
        on_change: Callable[[], None],
        *,
        backoff: Backoff | None = None,
        watch_timeout: tuple[float, float] = WATCH_TIMEOUT_RANGE,
    ) -> None:
        self.what = what
        self.objects: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.synced = False  # a list has succeeded (objects is a complete copy)
        self._list_call = list_call
        self._on_change = on_change
        self._backoff = backoff or Backoff()
        self._watch_timeout = watch_timeout
        self._events_since_list = False
        self._failing = ""  # the failure last logged as a WARNING, until a list succeeds

    def _failed(self, message: str) -> None:
        """Log a failure: a WARNING when it is new, DEBUG when it repeats the last one."""
        if message.split("; retrying in")[0] == self._failing.split("; retrying in")[0]:
            log.debug("%s: %s (again)", self.what, message)
            return
        self._failing = message
        log.warning("%s: %s", self.what, message)

    async def run(self) -> None:
        relist = True
        while True:
            try:
                if relist:
                    await self._list()
                    relist = False
                    self._backoff.reset()
                    if self._failing:
                        log.info("%s: listed again after: %s", self.what, self._failing)
                        self._failing = ""
                delivered = await self._watch()
                if not delivered:
                    await asyncio.sleep(self._backoff.next())  # a watch that closes at once: do not spin
            except Gone as exc:
                log.info("%s: watch expired (%s); re-listing", self.what, exc.message)
                relist = True
                if not self._events_since_list:  # 410 straight after a list: do not spin
                    await asyncio.sleep(self._backoff.next())
            except ApiError as exc:
                delay = self._backoff.next()
                self._failed(f"{exc}; retrying in {delay:.1f}s")
                relist = True
                await asyncio.sleep(delay)
            except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError) as exc:
                delay = self._backoff.next()
                then = "re-listing" if relist else f"resuming the watch from resourceVersion {self.resource_version}"
                self._failed(f"{type(exc).__name__}: {exc or 'no detail'}; {then} in {delay:.1f}s")
                await asyncio.sleep(delay)
            except Exception:  # a bug must not end discovery: log it, start over from a list
                delay = self._backoff.next()
                log.exception("%s: unexpected error; re-listing in %.1fs", self.what, delay)
                relist = True
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        timeout = aiohttp.ClientTimeout(total=_LIST_TIMEOUT_SECONDS, sock_connect=_CONNECT_TIMEOUT_SECONDS)
        response = await self._list_call(_preload_content=False, _request_timeout=timeout)
        await _check(response)
        try:
            body = await response.read()
        finally:
            response.release()
        decoded = msgspec.json.decode(body)
        if not isinstance(decoded, dict) or not isinstance(decoded.get("items"), list):
            raise ApiError(response.status, f"the list answer is not a list object: {body[:200]!r}")
        objects = {}
        for item in decoded["items"]:
            name = (item.get("metadata") or {}).get("name") if isinstance(item, dict) else None
            if name:
                objects[name] = item
        self.objects = objects
        self.resource_version = str((decoded.get("metadata") or {}).get("resourceVersion", ""))
        self.synced = True
        self._events_since_list = False
        log.debug("%s: listed %d object(s) at resourceVersion %s", self.what, len(objects), self.resource_version)
        self._on_change()

    async def _watch(self) -> bool:
        """Watch until the server ends the stream; True if any event (bookmarks included) arrived."""
        low, high = self._watch_timeout
        server_timeout = int(random.uniform(low, high))
        timeout = aiohttp.ClientTimeout(
            sock_connect=_CONNECT_TIMEOUT_SECONDS, sock_read=server_timeout + _READ_GRACE_SECONDS
        )
        response = await self._list_call(
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=server_timeout,
            _preload_content=False,
            _request_timeout=timeout,
        )
        await _check(response)
        delivered = False
        buffer = b""
        try:
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                changed = False
                for line in lines:
                    if line.strip():
                        changed |= self._apply(line)
                        delivered = True
                if delivered:
                    self._backoff.reset()
                    self._events_since_list = True
                if changed:
                    self._on_change()
        finally:
            response.close()
        if buffer.strip():  # a last event without its newline
            if self._apply(buffer):
                self._on_change()
            delivered = True
        return delivered

    def _apply(self, line: bytes) -> bool:
        """Apply one watch event; True if the objects changed."""
        event = msgspec.json.decode(line)
        kind = event.get("type") if isinstance(event, dict) else None
        obj = event.get("object") if isinstance(event, dict) else None
        if not isinstance(obj, dict):
            raise ApiError(500, f"malformed watch event: {line[:200]!r}")
        if kind == "ERROR":
            code = int(obj.get("code") or 500)
            raise (Gone if code == 410 else ApiError)(
                code, str(obj.get("message") or obj.get("reason") or "watch error")
            )
        metadata = obj.get("metadata") or {}
        version = metadata.get("resourceVersion")
        if version:
            self.resource_version = str(version)
        if kind == "BOOKMARK":
            return False
        name = metadata.get("name")
        if not name:
            log.warning("%s: a %s event without a name; ignored", self.what, kind)
            return False
        if kind in ("ADDED", "MODIFIED"):
            self.objects[name] = obj
        elif kind == "DELETED":
            if self.objects.pop(name, None) is None:
                return False
        else:
            log.warning("%s: unknown watch event type %r; ignored", self.what, kind)
            return False
        return True
