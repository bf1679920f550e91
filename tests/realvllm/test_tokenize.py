"""The picker's token ids equal real vLLM 0.32's, for completions and chat requests of many shapes.

One vLLM server of the tier's tiny model, started here with a tokenizer made by
``epp.testing.tokenizer`` (the tier's BPE plus ChatML tokens, a post-processor that adds BOS as
Llama's does, the Llama-like template) and ``--trust-request-chat-template``, so that each request
can carry another template; ``--enable-scale-out`` for the render endpoints; the LoRA adapter. Each
case is compared with the server's ``/tokenize`` and with the ``prompt_token_ids`` a generation
request returns (``return_token_ids``): the latter is the engine's own input.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from epp.prefix.remote import RemoteTokenizer
from epp.prefix.tokenize import ModelTokenizer, Unsupported
from epp.testing.tokenizer import TEMPLATES, write_tokenizer_dir
from epp.testing.vllm import ADAPTER, BASE, VllmServer, start_vllm, tier_paths
from epp.testing.vllm import http_post as post


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, ModelTokenizer]]:
    paths = tier_paths()
    if paths is None:
        pytest.skip("the real-vLLM tier needs EPP_VLLM_PYTHON and EPP_VLLM_MODELS (tests/realvllm/setup_tier.sh)")
    python, models = paths
    directory = write_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"), template="llama", add_bos=True)
    server = start_vllm(
        python, models, "tokenize", lora=True, kv_events=False,
        extra_args=["--tokenizer", str(directory), "--trust-request-chat-template", "--enable-scale-out"],
    )  # fmt: skip
    try:
        server.wait_healthy()
        yield server, ModelTokenizer.from_dir(directory)
    finally:
        server.stop()


def _generated_prompt(server: VllmServer, path: str, body: dict) -> list[int]:
    status, reply = post(f"{server.url}{path}", {**body, "max_tokens": 1, "return_token_ids": True})
    assert status == 200, reply[:500]
    parsed = json.loads(reply)
    ids = parsed.get("prompt_token_ids") or parsed["choices"][0].get("prompt_token_ids")
    assert ids is not None, parsed
    if len(parsed["choices"]) == 1:
        assert len(ids) == parsed["usage"]["prompt_tokens"]
    return list(ids)


def _tokenized(server: VllmServer, body: dict) -> list[int]:
    fields = {k: v for k, v in body.items() if k not in ("documents", "reasoning_effort", "truncate_prompt_tokens",
                                                         "truncation_side", "max_tokens")}  # fmt: skip
    status, reply = post(f"{server.url}/tokenize", fields)
    assert status == 200, reply[:500]
    return list(json.loads(reply)["tokens"])


_CONVERSATION = [
    {"role": "system", "content": "  you are the picker.  "},
    {"role": "user", "content": "hello world, one two three?"},
    {"role": "assistant", "content": "the answer is five."},
    {"role": "user", "content": "and six? ünïcödé\n\nsecond paragraph"},
]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "pick",
            "description": "pick a pod",
            "parameters": {"type": "object", "properties": {"pod": {"type": "string"}}},
        },
    }
]
_TOOL_TURNS = [
    {"role": "user", "content": "route this request"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": '{"pod": "a", "n": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "picked"}]},
]  # fmt: skip

CHATS = {
    "llama-default": {"messages": _CONVERSATION},
    "llama-no-generation-prompt": {"messages": _CONVERSATION, "add_generation_prompt": False},
    "llama-bos-again": {"messages": _CONVERSATION, "add_special_tokens": True},
    "llama-parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"},
                                                              {"type": "text", "text": "two"}]}]},
    "llama-developer": {"messages": [{"role": "developer", "content": "dev rules"}, {"role": "system", "content": "s"},
                                     {"role": "user", "content": "hi"}]},
    "llama-continue": {"messages": [*_CONVERSATION[:3]], "add_generation_prompt": False,
                       "continue_final_message": True},
    "tiny": {"messages": _CONVERSATION, "chat_template": TEMPLATES["tiny"]},
    "chatml-tools": {"messages": [{"role": "system", "content": "sys"}, *_TOOL_TURNS], "tools": _TOOLS, "tool_choice": "none",
                     "chat_template": TEMPLATES["chatml-tools"]},
    "chatml-parts": {"messages": [{"role": "system", "content": [{"type": "text", "text": "a"}]},
                                  {"role": "user", "content": [{"type": "text", "text": "b"},
                                                               {"type": "input_text", "text": "c"}]}],
                     "chat_template": TEMPLATES["chatml-tools"]},
    "kwargs": {"messages": _CONVERSATION, "chat_template_kwargs": {"flavour": "salty"},
               "chat_template": "{{ bos_token }}{{ flavour }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"},
    "reasoning-effort": {"messages": _CONVERSATION, "reasoning_effort": "low",
                         "chat_template": "{{ enable_thinking }}-{{ reasoning_effort }}{% for m in messages %}"
                                          "{{ m.content }}</s>{% endfor %}"},
    "documents": {"messages": _CONVERSATION, "documents": [{"title": "t", "text": "doc text"}],
                  "chat_template": "{% for d in documents %}{{ d.text }}</s>{% endfor %}"
                                   "{% for m in messages %}{{ m.content }}{% endfor %}"},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CHATS))
def test_chat_ids_equal_vllms(served: tuple[VllmServer, ModelTokenizer], case: str) -> None:
    server, tokenizer = served
    body = {"model": BASE, **copy.deepcopy(CHATS[case])}
    ours = tokenizer.request_ids("chat_completions", json.dumps(body).encode()).tolist()
    assert ours == _generated_prompt(server, "/v1/chat/completions", body)
    if "documents" not in body and "reasoning_effort" not in body:  # /tokenize does not take them
        assert ours == _tokenized(server, body)


COMPLETIONS = {
    "string": {"prompt": "hello world, the pod picks the prefix."},
    "no-bos": {"prompt": "hello world", "add_special_tokens": False},
    "special-inside": {"prompt": "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"},
    "unicode": {"prompt": "ünïcödé  spaces\n\n\tand tabs 1234"},
    "list-of-strings": {"prompt": ["first prompt here", "second"]},
    "token-ids": {"prompt": [1, 300, 301, 302, 5]},
    "truncated": {"prompt": "one two three four five six seven eight nine ten", "truncate_prompt_tokens": 4},
    "truncated-right": {"prompt": "one two three four five six seven eight nine ten", "truncate_prompt_tokens": 4,
                        "truncation_side": "right"},
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(COMPLETIONS))
def test_completion_ids_equal_vllms(served: tuple[VllmServer, ModelTokenizer], case: str) -> None:
    server, tokenizer = served
    body = {"model": BASE, **COMPLETIONS[case]}
    ours = tokenizer.request_ids("completions", json.dumps(body).encode()).tolist()
    assert ours == _generated_prompt(server, "/v1/completions", body)
    if isinstance(body["prompt"], str) and "truncate_prompt_tokens" not in body:
        assert ours == _tokenized(server, body)


def test_a_lora_request_has_the_base_models_ids(served: tuple[VllmServer, ModelTokenizer]) -> None:
    server, tokenizer = served
    for path, api, body in (
        ("/v1/chat/completions", "chat_completions", {"model": ADAPTER, "messages": _CONVERSATION}),
        ("/v1/completions", "completions", {"model": ADAPTER, "prompt": "hello adapter world"}),
    ):
        ours = tokenizer.request_ids(api, json.dumps(body).encode()).tolist()
        assert ours == _generated_prompt(server, path, body)


def test_a_growing_conversation_reuses_its_prefix_and_stays_exact(served: tuple[VllmServer, ModelTokenizer]) -> None:
    server, tokenizer = served
    messages: list[dict] = [{"role": "system", "content": "you are the picker"}]
    before = tokenizer.stats()
    for turn in range(4):
        messages.append({"role": "user", "content": f"question {turn}: " + "one two three " * (turn + 1)})
        body = {"model": BASE, "messages": messages}
        ours = tokenizer.request_ids("chat_completions", json.dumps(body).encode()).tolist()
        assert ours == _generated_prompt(server, "/v1/chat/completions", body)
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    after = tokenizer.stats()
    assert after.cache_hits - before.cache_hits >= 3 and after.reused_tokens > before.reused_tokens


def test_a_long_cold_prompts_head_starts_vllms_ids(served: tuple[VllmServer, ModelTokenizer]) -> None:
    """The head a long prompt never seen is looked up by (its first ~500 bytes encoded alone, the last few
    ids dropped: the precise producer's "A cold prompt's head") is the start of what vLLM computes."""
    server, tokenizer = served
    rng = random.Random(7)
    words = ["route", "the", "pods,", "cache-aware", "ünïcödé", "1234", "(blocks)", "don't", "\n\n", "tokens."]
    for i in range(8):
        text = f"{i} " + " ".join(rng.choice(words) for _ in range(400))
        for api, body in (("chat_completions", {"model": BASE, "messages": [{"role": "user", "content": text}]}),
                          ("completions", {"model": BASE, "prompt": text})):  # fmt: skip
            plan = tokenizer.plan(api, json.dumps(body).encode())
            assert plan.head and plan.known is not None, (api, i)
            known = plan.known.tolist()
            assert _tokenized(server, body)[: len(known)] == known, (api, i)
            assert plan.finish().tolist()[: len(known)] == known


def test_the_remote_fallbacks_give_the_same_ids(served: tuple[VllmServer, ModelTokenizer]) -> None:
    server, tokenizer = served
    chat = json.dumps({"model": BASE, **CHATS["chatml-tools"]}).encode()
    prompt = json.dumps({"model": BASE, "prompt": "hello world"}).encode()

    async def ask(mode: str, api: str, body: bytes) -> np.ndarray:
        remote = RemoteTokenizer(mode=mode, timeout=30)
        try:
            return await remote.token_ids(server.url, api, body)
        finally:
            await remote.close()

    for mode in ("tokenize", "render"):
        assert asyncio.run(ask(mode, "chat_completions", chat)).tolist() == tokenizer.request_ids(
            "chat_completions", chat).tolist()  # fmt: skip
        assert asyncio.run(ask(mode, "completions", prompt)).tolist() == tokenizer.request_ids(
            "completions", prompt).tolist()  # fmt: skip


def test_multimodal_content_is_left_to_the_fallback(served: tuple[VllmServer, ModelTokenizer]) -> None:
    _, tokenizer = served
    body = {"model": BASE, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}  # fmt: skip
    with pytest.raises(Unsupported):
        tokenizer.request_ids("chat_completions", json.dumps(body).encode())


def test_the_tier_models_own_tokenizer_loads(served: tuple[VllmServer, ModelTokenizer]) -> None:
    paths = tier_paths()
    assert paths is not None
    own = ModelTokenizer.from_dir(Path(paths[1]) / "llama")
    assert (
        own.completion_ids("hello world").tolist()
        == own.completion_ids("hello world", add_special_tokens=False).tolist()
    )
    assert own.chat_text([{"role": "user", "content": "hi"}]) == "<|user|>\nhi</s>\n<|assistant|>\n"
