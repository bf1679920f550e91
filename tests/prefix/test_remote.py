"""epp.prefix.remote: token ids from an engine's /tokenize (the simulator's here; real vLLM's in the tier),
bounded by a timeout, behind a circuit breaker that stops a dead tokenizer from costing every request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from epp.prefix.remote import Breaker, RemoteError, RemoteTokenizer, tokenize_body
from epp.sim.config import EngineConfig
from epp.sim.openai import Message, chat_prompt, completion_prompts
from epp.sim.pool import SimulatedPool


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_after_consecutive_failures_then_lets_one_trial_through() -> None:
    clock = _Clock()
    breaker = Breaker(failures=3, cooldown=2.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    breaker.success()  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now = 2.0
    assert breaker.state == "half-open" and breaker.allow()  # the one trial
    assert not breaker.allow()  # no second one while it is out
    breaker.failure()
    assert breaker.state == "open"
    clock.now = 5.9  # a failed trial doubles the cooldown: 4 s from 2.0
    assert not breaker.allow()
    clock.now = 6.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.opened == 2


def test_the_tokenize_body_keeps_what_changes_the_ids_and_refuses_what_tokenize_cannot_take() -> None:
    body = json.loads(tokenize_body("chat_completions", json.dumps({
        "model": "ad1", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
        "tools": [], "add_generation_prompt": False, "chat_template_kwargs": {"a": 1}}).encode()))  # fmt: skip
    assert body == {"messages": [{"role": "user", "content": "x"}], "tools": [], "add_generation_prompt": False,
                    "chat_template_kwargs": {"a": 1}}  # fmt: skip
    assert json.loads(tokenize_body("completions", b'{"model": "m", "prompt": "hi", "echo": true}')) == {"prompt": "hi"}
    for api, raw in (
        ("completions", b'{"prompt": ["a", "b"]}'),
        ("completions", b'{"prompt": "a", "truncate_prompt_tokens": 2}'),
        ("chat_completions", b'{"messages": [], "documents": [{"text": "d"}]}'),
        ("chat_completions", b'{"prompt": "no messages"}'),
        ("embeddings", b'{"input": "x"}'),
        ("completions", b"not json"),
    ):
        with pytest.raises(RemoteError) as caught:
            tokenize_body(api, raw)
        assert caught.value.reason == "unsupported"


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    pool = SimulatedPool(1, EngineConfig(enable_scale_out=True))
    await pool.start()
    try:
        yield next(iter(pool)).url
    finally:
        await pool.stop()


async def test_ids_from_the_simulators_tokenize_and_render_endpoints(sim: str) -> None:
    model = EngineConfig().model.encode()
    seen: list[float] = []
    for mode in ("tokenize", "render"):
        remote = RemoteTokenizer(mode=mode, timeout=5, observe=seen.append)
        try:
            chat = await remote.token_ids(sim, "chat_completions",
                                          b'{"model": "%s", "messages": [{"role": "user", "content": "hello"}]}' % model)
            assert chat.tolist() == chat_prompt([Message("user", "hello")]).tolist()
            prompt = await remote.token_ids(sim, "completions", b'{"model": "%s", "prompt": "hello world"}' % model)
            assert prompt.tolist() == completion_prompts("hello world")[0].tolist()
        finally:
            await remote.close()
    assert len(seen) == 4


@pytest.fixture
async def stub() -> AsyncIterator[tuple[str, dict[str, object]]]:
    """A /tokenize that answers as ``behaviour`` says: delay (s), status, body."""
    behaviour: dict[str, object] = {"delay": 0.0, "status": 200, "body": b'{"tokens": [1, 2, 3]}', "calls": 0}

    async def tokenize(request: web.Request) -> web.Response:
        behaviour["calls"] = int(behaviour["calls"]) + 1  # type: ignore[call-overload]
        await asyncio.sleep(float(behaviour["delay"]))  # type: ignore[arg-type]
        return web.Response(status=int(behaviour["status"]), body=behaviour["body"])  # type: ignore[call-overload]

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", behaviour
    finally:
        await runner.cleanup()


async def test_a_slow_tokenizer_opens_the_breaker_and_then_costs_nothing(stub: tuple[str, dict[str, object]]) -> None:
    url, behaviour = stub
    remote = RemoteTokenizer(timeout=0.05, breaker=Breaker(failures=3, cooldown=60))
    body = b'{"prompt": "x"}'
    try:
        assert (await remote.token_ids(url, "completions", body)).tolist() == [1, 2, 3]
        behaviour["delay"] = 1.0
        reasons = []
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(10):
            try:
                await remote.token_ids(url, "completions", body)
            except RemoteError as exc:
                reasons.append(exc.reason)
        elapsed = loop.time() - started
        assert reasons == ["timeout"] * 3 + ["open"] * 7
        assert elapsed < 0.05 * 3 + 0.5  # the seven after the breaker opened cost no timeout
        assert behaviour["calls"] == 4
    finally:
        await remote.close()


async def test_answers_that_are_no_ids_and_requests_the_engine_refuses(stub: tuple[str, dict[str, object]]) -> None:
    url, behaviour = stub
    remote = RemoteTokenizer(timeout=1, breaker=Breaker(failures=2, cooldown=60))
    try:
        behaviour["status"], behaviour["body"] = 400, b'{"error": "bad prompt"}'
        for _ in range(3):
            with pytest.raises(RemoteError) as caught:
                await remote.token_ids(url, "completions", b'{"prompt": "x"}')
            assert caught.value.reason == "rejected"
        assert remote.breaker.state == "closed"  # the request was bad, not the tokenizer
        behaviour["status"], behaviour["body"] = 200, b"<html>"
        with pytest.raises(RemoteError) as caught:
            await remote.token_ids(url, "completions", b'{"prompt": "x"}')
        assert caught.value.reason == "status"
        with pytest.raises(RemoteError) as caught:
            await remote.token_ids("http://127.0.0.1:1", "completions", b'{"prompt": "x"}')
        assert caught.value.reason == "error" and remote.breaker.state == "open"
    finally:
        await remote.close()
