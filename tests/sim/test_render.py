"""The token endpoints of a simulated pod (epp.sim.render): /tokenize and the scale-out render routes."""

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

import epp.sim.render
from epp.prefix.tokenize import ModelTokenizer
from epp.sim import EngineConfig, SimulatedPool
from epp.sim.render import SCALE_OUT_PATHS
from epp.testing.tokenizer import write_tokenizer_dir

MODEL = EngineConfig().model
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def make_pool() -> AsyncIterator[Callable[..., object]]:
    pools: list[SimulatedPool] = []

    async def make(**overrides: object) -> SimulatedPool:
        pool = SimulatedPool(1, EngineConfig(**{"time_scale": 0.05, **overrides}))  # type: ignore[arg-type]
        await pool.start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.stop()


async def _post(session: aiohttp.ClientSession, url: str, body: object) -> tuple[int, object]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


def test_public_api_is_locked() -> None:
    assert epp.sim.render.__all__ == ["RENDER_PATHS", "SCALE_OUT_PATHS", "add_token_routes"]


async def test_tokenize_gives_the_tokens_generation_counts(make_pool, session) -> None:
    pool = await make_pool()
    url = pool.url(0)
    prompt = "the same prompt, tokenised and served " * 3
    status, tok = await _post(session, url + "/tokenize", {"model": MODEL, "prompt": prompt})
    assert status == 200
    _, done = await _post(session, url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert tok["count"] == len(tok["tokens"]) == done["usage"]["prompt_tokens"]
    assert tok["max_model_len"] == pool[0].config.max_model_len and tok["token_strs"] is None
    # add_special_tokens=false drops the BOS token; token_strs are the 4-byte pieces of the text
    _, bare = await _post(session, url + "/tokenize", {"prompt": prompt, "add_special_tokens": False,
                                                       "return_token_strs": True})
    assert bare["tokens"] == tok["tokens"][1:]
    assert "".join(bare["token_strs"]) == prompt and len(bare["token_strs"]) == bare["count"]

    _, chat = await _post(session, url + "/tokenize", {"model": MODEL, "messages": CHAT})
    _, chat_done = await _post(session, url + "/v1/chat/completions",
                               {"model": MODEL, "messages": CHAT, "max_tokens": 1})
    assert chat["count"] == chat_done["usage"]["prompt_tokens"]
    _, open_end = await _post(session, url + "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert open_end["tokens"] == chat["tokens"][: open_end["count"]] and open_end["count"] < chat["count"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "`nope` does not exist"),
        ({"prompt": "x", "messages": CHAT}, 400, "either prompt or messages"),
        ({}, 400, "either prompt or messages"),
        ({"prompt": 3}, 400, "invalid request body"),
        ({"messages": CHAT, "return_token_strs": True}, 400, "return_token_strs"),
    ],
)
async def test_tokenize_refuses_bad_bodies(make_pool, session, body, status, says) -> None:
    pool = await make_pool()
    got, answer = await _post(session, pool.url(0) + "/tokenize", body)
    assert got == status and says in answer["error"]["message"]


async def test_scale_out_routes_are_403_unless_enabled(make_pool, session) -> None:
    # vLLM 0.32 answers every render/derender/generate route with 403 PermissionDeniedError without
    # --enable-scale-out (vllm/entrypoints/scale_out/factories.py).
    pool = await make_pool()
    for path in SCALE_OUT_PATHS:
        status, answer = await _post(session, pool.url(0) + path, {"model": MODEL, "prompt": "x"})
        assert status == 403, path
        assert answer["error"]["type"] == "PermissionDeniedError" and "--enable-scale-out" in answer["error"]["message"]


async def test_render_with_scale_out_gives_the_prompt_tokens(make_pool, session) -> None:
    pool = await make_pool(enable_scale_out=True)
    url = pool.url(0)
    _, tok = await _post(session, url + "/tokenize", {"prompt": "render me"})
    status, rendered = await _post(session, url + "/v1/completions/render",
                                   {"model": MODEL, "prompt": ["render me", "and me"], "max_tokens": 7})
    assert status == 200 and len(rendered) == 2
    assert rendered[0]["token_ids"] == tok["tokens"] and rendered[0]["sampling_params"] == {"max_tokens": 7}
    _, chat_tok = await _post(session, url + "/tokenize", {"messages": CHAT})
    status, chat = await _post(session, url + "/v1/chat/completions/render", {"model": MODEL, "messages": CHAT})
    assert status == 200 and chat["token_ids"] == chat_tok["tokens"] and chat["model"] == MODEL
    status, _ = await _post(session, url + "/v1/chat/completions/render", {"model": "nope", "messages": CHAT})
    assert status == 404
    status, answer = await _post(session, url + "/inference/v1/generate", {"token_ids": [1]})
    assert status == 501 and "not simulated" in answer["error"]["message"]


async def test_with_the_models_tokenizer_every_route_gives_the_pickers_ids(
    session: aiohttp.ClientSession, make_pool: Callable[..., object], tmp_path: Path
) -> None:
    directory = write_tokenizer_dir(tmp_path, template="chatml-tools", add_bos=True)
    tokenizer = ModelTokenizer.from_dir(directory)
    pool = await make_pool(tokenizer=str(directory), enable_scale_out=True)
    url = pool.url(0)  # type: ignore[attr-defined]
    chat = {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}
    expected = tokenizer.request_ids("chat_completions", json.dumps(chat).encode()).tolist()
    status, reply = await _post(session, f"{url}/tokenize", {**chat, "return_token_strs": True})
    assert status == 200 and reply["tokens"] == expected  # type: ignore[index]
    assert reply["token_strs"][0] == "<|im_start|>"  # type: ignore[index]
    status, reply = await _post(session, f"{url}/v1/chat/completions/render", chat)
    assert status == 200 and reply["token_ids"] == expected  # type: ignore[index]
    status, reply = await _post(session, f"{url}/v1/chat/completions", {**chat, "max_tokens": 2})
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(expected)  # type: ignore[index]
    prompt = {"model": MODEL, "prompt": ["hello world", "one two"], "max_tokens": 2}
    status, reply = await _post(session, f"{url}/v1/completions/render", prompt)
    assert status == 200 and [r["token_ids"] for r in reply] == [  # type: ignore[union-attr]
        tokenizer.completion_ids(p).tolist() for p in prompt["prompt"]]  # fmt: skip
    status, reply = await _post(session, f"{url}/tokenize", {"model": MODEL, "prompt": "hi", "add_special_tokens": False})
    without_bos = tokenizer.completion_ids("hi", add_special_tokens=False).tolist()
    assert status == 200 and reply["tokens"] == without_bos  # type: ignore[index]
    part = {"type": "image_url", "image_url": {"url": "x"}}
    image = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
    status, reply = await _post(session, f"{url}/v1/chat/completions", image)
    assert status == 400 and "tokenizer cannot take" in reply["error"]["message"]  # type: ignore[index]
