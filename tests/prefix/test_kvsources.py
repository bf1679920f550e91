"""epp.prefix.kvsources: a server's data-parallel ranks from its /kv_event_sources."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from epp.prefix.kvsources import RankDiscovery, RankSource, parse_sources

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm-0.32"


def test_vllms_pages_give_each_ranks_publisher() -> None:
    dp2 = json.loads((DATA / "kv_event_sources-dp2.json").read_text())
    assert parse_sources(dp2) == [RankSource(0, 52499, None), RankSource(1, 52500, None)]
    one = json.loads((DATA / "kv_event_sources.json").read_text())
    assert parse_sources(one) == [RankSource(0, 18401, None)]


def test_what_is_not_a_ranks_publisher_is_skipped() -> None:
    assert parse_sources({}) == []
    assert parse_sources(["0"]) == []
    document = {
        "0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5600"},
        "1": {"endpoint": "ipc:///tmp/kv"},  # no tcp port: the rank is named, its port is not
        "x": {"endpoint": "tcp://*:1"},
        "2": "tcp://*:5559",
    }
    assert parse_sources(document) == [RankSource(0, 5557, 5600), RankSource(1, None, None)]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_a_server_is_asked_again_until_it_answers_and_one_without_the_route_once() -> None:
    asked: list[str] = []
    answers = iter([web.Response(status=503), web.json_response({"0": {"endpoint": "tcp://*:5557"},
                                                                 "1": {"endpoint": "tcp://*:5558"}})])  # fmt: skip

    async def sources(request: web.Request) -> web.Response:
        asked.append("dp")
        return next(answers)

    async def missing(request: web.Request) -> web.Response:
        asked.append("sglang")
        return web.Response(status=404)

    dp, sglang = web.Application(), web.Application()
    dp.router.add_get("/kv_event_sources", sources)
    sglang.router.add_get("/kv_event_sources", missing)
    found: dict[str, list[RankSource]] = {}
    discovery = RankDiscovery(lambda key, ranks: found.__setitem__(key, ranks), first_delay=0.05)
    runners = []
    try:
        for app in (dp, sglang):
            runner, url = await _serve(app)
            runners.append(runner)
            discovery.watch(url, url)
        for _ in range(200):
            if discovery.watching() == 0:
                break
            await asyncio.sleep(0.01)
        assert discovery.watching() == 0
        assert list(found.values()) == [[RankSource(0, 5557, None), RankSource(1, 5558, None)]]
        assert sorted(asked) == ["dp", "dp", "sglang"]
    finally:
        await discovery.close()
        for runner in runners:
            await runner.cleanup()


async def test_a_server_that_is_not_there_is_asked_again_until_the_watch_ends() -> None:
    runner, url = await _serve(web.Application())
    await runner.cleanup()  # nothing listens there now
    discovery = RankDiscovery(lambda key, ranks: None, first_delay=0.01, max_delay=0.02)
    discovery.watch("gone", url)
    await asyncio.sleep(0.2)
    assert discovery.watching() == 1
    discovery.cancel("gone")
    await asyncio.sleep(0)
    assert discovery.watching() == 0
    await discovery.close()
