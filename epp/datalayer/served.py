"""The model poller: what each endpoint serves, read from its ``GET /v1/models`` on a slow cadence.

Design
------
A model server lists its base model(s) and its loaded LoRA adapters at ``/v1/models`` (vLLM: the
base with ``parent: null``, each adapter with its base as ``parent``). The list changes rarely (an
adapter loaded or unloaded), so it is read every ``interval`` (30 s by default; upstream polls it
with the rest of its data layer and has no flag of its own for it), not at the metrics page's
50 ms. One task owns every endpoint's schedule: it sleeps until the earliest endpoint is due, or
until it is woken, and polls the due ones concurrently with one aiohttp session (a general client
is fine at this rate; the metrics scraper's hand-made client exists for 2,000 requests a second).

It is woken by:

* a membership change: a new endpoint is polled at once, not 30 s later;
* a 404 on the response path (:meth:`~epp.datalayer.datastore.Datastore.not_found`): the pod was
  sent a model it did not serve, so its list is re-read after ``recheck_after`` (1 s: soon, yet a
  burst of 404s costs one poll).

A list read replaces the endpoint's :class:`~epp.framework.ServedModels`
(:meth:`~epp.datalayer.datastore.Datastore.update_served`). A failed poll (connection refused, a
timeout, a non-200, a body that is not an OpenAI model list) keeps the last list: a pod that
restarts keeps what it served, and one whose server has no ``/v1/models`` (Triton) stays
"unknown" (``NOT_LISTED``), which the served-model filter never narrows on. Failures are logged at
debug, and once per endpoint at info.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import msgspec

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint, ServedModels

__all__ = ["USER_AGENT", "ModelPoller", "parse_model_list"]

USER_AGENT = "epp-model-poller"  # tells the poller's GETs from client traffic in a server's logs

log = logging.getLogger(__name__)


class _ModelList(msgspec.Struct):
    data: list[dict[str, Any]]


_decoder = msgspec.json.Decoder(_ModelList)


def parse_model_list(body: bytes, updated_at: float = 0.0) -> ServedModels:
    """The :class:`ServedModels` of a ``/v1/models`` body; ValueError when it is not a model list."""
    try:
        listing = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not an OpenAI model list: {exc}") from None
    return ServedModels.from_entries(listing.data, updated_at)


class ModelPoller:
    """Polls every endpoint of ``datastore`` for its model list; ``start()`` then ``await stop()``."""

    def __init__(
        self,
        datastore: Datastore,
        *,
        interval: float = 30.0,
        path: str = "/v1/models",
        scheme: str = "http",
        timeout: float = 5.0,
        recheck_after: float = 1.0,
    ) -> None:
        self.datastore = datastore
        self.interval = interval
        self.path = path
        self.scheme = scheme
        self.timeout = timeout
        self.recheck_after = recheck_after
        self._due: dict[str, float] = {}  # endpoint name -> time.monotonic() of its next poll
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._reported: set[str] = set()  # endpoints whose failure was logged at info
        datastore.subscribe(self._pool_changed)
        datastore.on_not_found(self._not_found)
        for endpoint in datastore.endpoints():
            self._due[endpoint.name] = 0.0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="model-poller")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _pool_changed(self, added: tuple[Endpoint, ...], removed: tuple[Endpoint, ...]) -> None:
        kept = {endpoint.name for endpoint in added}  # a re-labelled endpoint is removed and added
        for endpoint in removed:
            if endpoint.name not in kept:
                self._due.pop(endpoint.name, None)
        for endpoint in added:
            if endpoint.name not in self._due or not endpoint.served.listed:
                self._due[endpoint.name] = 0.0
        self._wake.set()

    def _not_found(self, name: str) -> None:
        due = self._due.get(name)
        soon = time.monotonic() + self.recheck_after
        if due is not None and due > soon:
            self._due[name] = soon
            self._wake.set()

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, headers={"User-Agent": USER_AGENT}) as session:
            while True:
                now = time.monotonic()
                due = [name for name, when in self._due.items() if when <= now]
                if due:
                    await asyncio.gather(*(self._poll(session, name) for name in due))
                    continue
                self._wake.clear()
                wait = min(self._due.values(), default=now + self.interval) - now
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(wait, 0.0)):
                        await self._wake.wait()

    async def _poll(self, session: aiohttp.ClientSession, name: str) -> None:
        self._due[name] = time.monotonic() + self.interval
        endpoint = self.datastore.get(name)
        if endpoint is None:
            return
        url = f"{self.scheme}://{endpoint.hostport}{self.path}"
        try:
            async with session.get(url, ssl=False) as response:
                body = await response.read()
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
            served = parse_model_list(body, time.monotonic())
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            level = logging.DEBUG if name in self._reported else logging.INFO
            self._reported.add(name)
            log.log(level, "endpoint %s: cannot read its model list at %s (%s); keeping the last one", name, url, exc)
            return
        self._reported.discard(name)
        if self.datastore.update_served(name, served):
            log.debug("endpoint %s serves %s", name, sorted(served.base_models | served.adapters.keys()))
