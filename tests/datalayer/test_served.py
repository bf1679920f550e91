"""The model poller: /v1/models read per endpoint, kept across failures, re-read soon after a 404."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from aiohttp import web

from epp.datalayer.datastore import Datastore
from epp.datalayer.served import ModelPoller, parse_model_list
from epp.framework import NOT_LISTED, Endpoint, ServedModels


def test_a_vllm_model_list_parses_into_base_and_adapters() -> None:
    body = json.dumps({"object": "list", "data": [
        {"id": "base", "object": "model", "root": "/m/base", "parent": None},
        {"id": "sql", "object": "model", "root": "/m/sql", "parent": "base"},
    ]}).encode()  # fmt: skip
    served = parse_model_list(body, 3.0)
    assert served.base_models == {"base"} and dict(served.adapters) == {"sql": "base"} and served.updated_at == 3.0


@pytest.mark.parametrize("body", [b"", b"<html>", b'{"object": "list"}', b'{"data": 3}', b"[]"])
def test_what_is_not_a_model_list_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError, match="not an OpenAI model list"):
        parse_model_list(body)


class _Server:
    """A /v1/models that answers what the test sets, counting requests."""

    def __init__(self) -> None:
        self.data: list[dict[str, object]] | None = [{"id": "base", "parent": None}]
        self.status = 200
        self.requests = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def _models(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.json_response({"object": "list", "data": self.data}, status=self.status)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def _until(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_lists_are_polled_kept_on_failure_and_re_read_after_a_404() -> None:
    server = _Server()
    await server.start()
    datastore = Datastore([Endpoint("a", "127.0.0.1", server.port)])
    poller = ModelPoller(datastore, interval=60.0, recheck_after=0.05)
    poller.start()
    try:
        await _until(lambda: datastore.get("a").served.listed)  # type: ignore[union-attr]
        assert datastore.base_models() == {"base"}
        assert server.requests == 1
        server.status = 500  # a failed poll keeps the last list
        server.data = [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"}]
        datastore.not_found("a")
        await _until(lambda: server.requests == 2)
        await asyncio.sleep(0.05)
        assert datastore.get("a").served.base_models == {"base"}  # type: ignore[union-attr]
        assert not datastore.get("a").served.adapters  # type: ignore[union-attr]
        server.status = 200  # the next 404 re-reads soon, not 60 s later
        datastore.not_found("a")
        await _until(lambda: "sql" in datastore.get("a").served.adapters)  # type: ignore[union-attr]
        # A metrics update keeps the list; so does a re-listing of the same endpoint.
        datastore.replace([Endpoint("a", "127.0.0.1", server.port, labels={"zone": "z"})])
        assert datastore.get("a").served.is_adapter("sql")  # type: ignore[union-attr]
    finally:
        await poller.stop()
        await server.stop()


async def test_a_new_endpoint_is_polled_at_once_and_an_unreachable_one_stays_unknown() -> None:
    server = _Server()
    await server.start()
    datastore = Datastore()
    poller = ModelPoller(datastore, interval=60.0, timeout=0.5)
    poller.start()
    try:
        await asyncio.sleep(0.05)
        datastore.upsert(Endpoint("a", "127.0.0.1", server.port))
        datastore.upsert(Endpoint("dead", "127.0.0.1", 9))  # nothing listens on the discard port
        await _until(lambda: datastore.get("a").served.listed)  # type: ignore[union-attr]
        await asyncio.sleep(0.1)
        assert datastore.get("dead").served is NOT_LISTED  # type: ignore[union-attr]
    finally:
        await poller.stop()
        await server.stop()


def test_real_vllm_models_page_parses() -> None:
    # Captured from a real vLLM 0.32 server with --enable-lora --lora-modules ad1=... (tests/realvllm).
    path = Path(__file__).parents[1] / "data" / "vllm-0.32" / "v1-models-lora.json"
    served = parse_model_list(path.read_bytes())
    assert isinstance(served, ServedModels)
    assert served.base_models == frozenset({"tiny"}) and dict(served.adapters) == {"ad1": "tiny"}
