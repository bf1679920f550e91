"""epp.prefix.tokenize: the model's files loaded as transformers loads them, vLLM's token rules, and the
reuse of cached prefixes, which must always give exactly the ids of a whole tokenization."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken

from epp._libc import glibc_function
from epp.prefix import tokenize
from epp.prefix.chat import ChatOptions, TemplateError, Unsupported
from epp.prefix.tokenize import ModelTokenizer, TokenizerError
from epp.testing.tokenizer import TEMPLATES, WORDS, write_tokenizer_dir


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("llama"), template="llama", add_bos=True)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_dir(tmp_path_factory.mktemp("chatml"), template="chatml-tools", template_file=True,
                               add_bos=False)  # fmt: skip


def _whole(tok: ModelTokenizer, text: str, special: bool = False) -> list[int]:
    return list(tok.backend.encode(text, add_special_tokens=special).ids)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + rng.choice([".", "?", "\n", "  ", " é"])


# --- loading --------------------------------------------------------------------------------------


def test_loading_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        ModelTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        ModelTokenizer.from_dir(tmp_path)
    good = write_tokenizer_dir(tmp_path / "good")
    (good / "tokenizer_config.json").write_text('{"chat_template": 3}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        ModelTokenizer.from_dir(good)


def test_chat_template_jinja_wins_and_named_templates_load(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path, template="tiny")
    (directory / "chat_template.jinja").write_text("FILE")
    assert ModelTokenizer.from_dir(directory).chat_text([{"role": "user", "content": "x"}]) == "FILE"
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").unlink()
    tok = ModelTokenizer.from_dir(directory)
    assert set(tok.chat.templates) == {"default", "tool_use"}
    assert ModelTokenizer.from_dir(directory, chat_template="SERVER").chat_text([{"role": "user", "content": "x"}]) == "SERVER"


def test_add_bos_token_in_the_config_rebuilds_the_post_processor(tmp_path: Path) -> None:
    plain = ModelTokenizer.from_dir(write_tokenizer_dir(tmp_path / "a", add_bos=False))
    assert plain.completion_ids("hello").tolist() == _whole(plain, "hello")
    rebuilt = ModelTokenizer.from_dir(write_tokenizer_dir(tmp_path / "b", add_bos=False, add_bos_token=True))
    assert rebuilt.completion_ids("hello").tolist() == [1, *_whole(plain, "hello")]
    dropped = ModelTokenizer.from_dir(write_tokenizer_dir(tmp_path / "c", add_bos=True, add_bos_token=False))
    assert dropped.completion_ids("hello").tolist() == _whole(plain, "hello")


def test_special_tokens_missing_from_the_vocabulary_are_added(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["image_token"] = {"content": "<image>", "special": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tok = ModelTokenizer.from_dir(directory)
    assert tok.backend.token_to_id("<image>") is not None
    assert tok.chat.special_tokens["image_token"] == "<image>"


# --- vLLM's rules ---------------------------------------------------------------------------------


def test_completions_bos_and_truncation(llama_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(llama_dir)
    text = "one two three four five six seven"
    content = _whole(tok, text)
    assert tok.completion_ids(text).tolist() == [1, *content]
    assert tok.completion_ids(text, add_special_tokens=False).tolist() == content
    # The tokenizer truncates the text (from the left, as vLLM sets it), keeping room for BOS.
    assert tok.completion_ids(text, truncate_prompt_tokens=3).tolist() == [1, *content[-2:]]
    assert tok.completion_ids(text, truncate_prompt_tokens=3, truncation_side="left").tolist() == content[-3:]
    assert tok.completion_ids(text, truncate_prompt_tokens=3, truncation_side="right").tolist() == [1, *content[:2]]
    with pytest.raises(Unsupported):
        tok.completion_ids(text, truncate_prompt_tokens=-1)


def test_request_bodies(llama_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(llama_dir)

    def ids(api: str, body: object) -> list[int]:
        return tok.request_ids(api, json.dumps(body).encode()).tolist()

    assert ids("completions", {"prompt": ["hello", "world"]}) == [1, *_whole(tok, "hello")]
    assert ids("completions", {"prompt": [[7, 8], [9]]}) == [7, 8]
    assert ids("completions", {"prompt": [5, 6, 7], "truncate_prompt_tokens": 2}) == [6, 7]
    messages = [{"role": "user", "content": "hi"}]
    text = tok.chat_text(messages)
    assert ids("chat_completions", {"messages": messages}) == _whole(tok, text)
    assert ids("chat_completions", {"messages": messages, "add_special_tokens": True}) == [1, *_whole(tok, text)]
    assert ids("chat_completions", {"messages": messages, "kv_transfer_params": {"prompt_token_ids": [4, 5]}}) == [4, 5]
    for api, body in (
        ("completions", {"prompt_embeds": "AAAA", "prompt": "x"}),
        ("completions", {"prompt": 3}),
        ("completions", {"prompt": "x", "add_special_tokens": "yes"}),
        ("embeddings", {"input": "x"}),
    ):
        with pytest.raises(Unsupported):
            tok.request_ids(api, json.dumps(body).encode())
    with pytest.raises(Unsupported):
        tok.request_ids("chat_completions", b"not json")
    with pytest.raises(TemplateError):
        ids("chat_completions", {"messages": []})


# --- reuse of cached prefixes ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["llama", "chatml"])
def test_a_growing_conversation_gives_the_ids_of_a_whole_tokenization(which: str, llama_dir: Path,
                                                                      chatml_dir: Path) -> None:  # fmt: skip
    tok = ModelTokenizer.from_dir(llama_dir if which == "llama" else chatml_dir, cache_bytes=1 << 20)
    rng = random.Random(7)
    for conversation in range(3):
        messages: list[dict] = [{"role": "system", "content": f"system prompt {conversation} " + _text(rng, 40)}]
        for _ in range(6):
            messages.append({"role": "user", "content": _text(rng, rng.randint(1, 60))})
            options = ChatOptions(add_generation_prompt=rng.random() < 0.8)
            ids = tok.chat_ids(messages, options)
            assert ids.tolist() == _whole(tok, tok.chat_text(messages, options))
            messages.append({"role": "assistant", "content": _text(rng, rng.randint(1, 30))})
    stats = tok.stats()
    assert stats.cache_hits >= 12 and stats.reused_tokens > stats.encoded_tokens / 2
    assert stats.unstable == 0 and stats.unmapped == 0
    assert 0 < stats.cache_bytes <= 1 << 20


@pytest.mark.parametrize("which", ["llama", "chatml"])
def test_a_plan_knows_the_start_of_a_warm_prompt_before_encoding_it(which: str, llama_dir: Path,
                                                                    chatml_dir: Path) -> None:  # fmt: skip
    """``Plan.known`` is what ``finish`` will start with (the post-processor's tokens included), before
    any encoding; a cold or truncated prompt has none."""
    tok = ModelTokenizer.from_dir(llama_dir if which == "llama" else chatml_dir)
    rng = random.Random(3)
    messages: list[dict] = [{"role": "system", "content": _text(rng, 40)}, {"role": "user", "content": _text(rng, 9)}]

    def body(**extra: object) -> bytes:
        return json.dumps({"model": "m", "messages": messages, **extra}).encode()

    assert tok.plan("chat_completions", body()).known is None  # nothing cached yet
    tok.request_ids("chat_completions", body())
    for extra in ({}, {"add_special_tokens": True}):
        messages += [{"role": "assistant", "content": _text(rng, 12)}, {"role": "user", "content": _text(rng, 30)}]
        plan = tok.plan("chat_completions", body(**extra))
        before = tok.stats().encoded_tokens
        assert plan.known is not None and len(plan.known) > 40 and tok.stats().encoded_tokens == before
        ids = plan.finish()
        assert ids[: len(plan.known)].tolist() == plan.known.tolist()
        assert int(plan.known[-1]) in tok.backend.get_added_tokens_decoder()  # through a cut point, no further
        assert ids.tolist() == ModelTokenizer.from_dir(llama_dir if which == "llama" else chatml_dir).request_ids(
            "chat_completions", body(**extra)).tolist()  # fmt: skip
        assert len(plan.known) < plan.estimated and abs(plan.estimated - len(ids)) < len(ids) / 3
    messages += [{"role": "user", "content": _text(rng, 30)}]
    assert tok.plan("chat_completions", body(truncate_prompt_tokens=50)).known is None


def test_a_shared_system_prompt_is_reused_by_a_new_conversation(chatml_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(chatml_dir)
    system = {"role": "system", "content": "shared " * 300}
    tok.chat_ids([system, {"role": "user", "content": "first conversation"}])
    before = tok.stats()
    ids = tok.chat_ids([system, {"role": "user", "content": "another one"}])
    after = tok.stats()
    assert after.cache_hits == before.cache_hits + 1 and after.reused_tokens - before.reused_tokens >= 300
    assert ids.tolist() == _whole(tok, tok.chat_text([system, {"role": "user", "content": "another one"}]))


def test_the_cache_stays_within_its_bytes_and_zero_turns_it_off(llama_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(llama_dir, cache_bytes=20_000)
    rng = random.Random(1)
    for _ in range(40):
        tok.chat_ids([{"role": "user", "content": _text(rng, 200)}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "b"}])  # fmt: skip
        assert tok.stats().cache_bytes <= 20_000
    off = ModelTokenizer.from_dir(llama_dir, cache_bytes=0)
    messages = [{"role": "user", "content": "x"}]
    off.chat_ids(messages)
    off.chat_ids(messages)
    assert off.stats().cache_hits == 0 and off.stats().cache_entries == 0


def test_a_token_that_does_not_split_the_text_is_never_cut_at(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path)
    tok = ModelTokenizer.from_dir(directory)
    tok.backend.add_tokens([AddedToken("<w>", single_word=True, normalized=False)])
    fresh = ModelTokenizer(tok.backend, tok.chat)
    cuts = fresh._cut_ids  # what the probes let through
    assert b"<w>" not in cuts and b"</s>" in cuts


def test_audits_compare_with_a_whole_tokenization_and_a_mismatch_turns_reuse_off(llama_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(llama_dir)
    tok._audit_every = 1
    messages = [{"role": "user", "content": "one"}]
    tok.chat_ids(messages)
    messages += [{"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    ids = tok.chat_ids(messages)
    due = tok.pop_audit()
    assert due is not None and tok.audit(*due) and tok.incremental
    assert not tok.audit(due[0], np.array([1, 2, 3], dtype=np.uint32))
    assert not tok.incremental and tok.stats().audit_mismatches == 1 and tok.stats().cache_entries == 0
    assert tok.chat_ids(messages).tolist() == ids.tolist()  # tokenized whole from now on


def test_threads_share_the_cache_safely(chatml_dir: Path) -> None:
    tok = ModelTokenizer.from_dir(chatml_dir, cache_bytes=1 << 18)
    failures: list[str] = []

    def converse(seed: int) -> None:
        rng = random.Random(seed)
        messages: list[dict] = [{"role": "system", "content": "the same system prompt for all"}]
        for _ in range(8):
            messages.append({"role": "user", "content": _text(rng, rng.randint(5, 80))})
            if tok.chat_ids(messages).tolist() != _whole(tok, tok.chat_text(messages)):
                failures.append(f"seed {seed}")
            messages.append({"role": "assistant", "content": _text(rng, 10)})

    threads = [threading.Thread(target=converse, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and tok.stats().cache_hits > 20


def test_templates_render_the_same_text_from_either_place(tmp_path: Path) -> None:
    a = ModelTokenizer.from_dir(write_tokenizer_dir(tmp_path / "a", template=TEMPLATES["tiny"]))
    b = ModelTokenizer.from_dir(write_tokenizer_dir(tmp_path / "b", template="tiny", template_file=True))
    messages = [{"role": "user", "content": "x"}]
    assert a.chat_text(messages) == b.chat_text(messages) == "<|user|>\nx</s>\n<|assistant|>\n"


@pytest.mark.parametrize("which", ["llama", "chatml"])
def test_a_long_cold_prompt_knows_its_head_before_encoding_the_rest(which: str, llama_dir: Path,
                                                                      chatml_dir: Path) -> None:  # fmt: skip
    """A prompt the cache has nothing of, long enough, starts known as its head's ids (``Plan.head``): they
    begin the whole's ids, whatever words and whitespace; short prompts and heads without a space have none."""
    directory = llama_dir if which == "llama" else chatml_dir
    tok = ModelTokenizer.from_dir(directory)
    fresh = ModelTokenizer.from_dir(directory)
    rng = random.Random(7)
    separators = (" ", "  ", "\n", " \n", "\t", ", ", ". ")
    for trial in range(24):
        text = "".join(rng.choice(WORDS) + rng.choice(separators) for _ in range(rng.randrange(500, 900)))
        if trial % 2:
            body = json.dumps({"model": "m", "messages": [{"role": "system", "content": text},
                                                           {"role": "user", "content": "q"}]}).encode()  # fmt: skip
            api = "chat_completions"
        else:
            body, api = json.dumps({"model": "m", "prompt": text}).encode(), "completions"
        before = tok.stats().encoded_tokens
        plan = tok.plan(api, body)
        assert plan.head and plan.known is not None and len(plan.known) >= 32
        assert tok.stats().encoded_tokens - before < 200  # the head only, not the prompt
        ids = plan.finish()
        assert ids[: len(plan.known)].tolist() == plan.known.tolist()
        assert ids.tolist() == fresh.request_ids(api, body).tolist()
        assert abs(plan.estimated - len(ids)) < len(ids) / 3
    short = json.dumps({"model": "m", "prompt": "few words " * 100}).encode()
    no_space = json.dumps({"model": "m", "prompt": "x" * 4000}).encode()
    for body in (short, no_space):
        plan = tok.plan("completions", body)
        assert plan.known is None and not plan.head


# --- memory after a long prompt ---------------------------------------------------------------------


def test_heap_release_after_long_encodings_only_and_at_most_once_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    release = tokenize._HeapRelease(every=10.0)
    release._trim = lambda pad: calls.append(pad) or 1
    clock = [1000.0]
    monkeypatch.setattr(tokenize.time, "monotonic", lambda: clock[0])
    release.after_encoding(tokenize.RELEASE_AFTER_TOKENS)  # not more than the bound
    assert calls == []
    release.after_encoding(tokenize.RELEASE_AFTER_TOKENS + 1)
    assert calls == [0] and release.releases == 1
    clock[0] += 9.9
    release.after_encoding(10 * tokenize.RELEASE_AFTER_TOKENS)  # within the window: long prompts in a row
    assert calls == [0]
    clock[0] += 0.2
    release.after_encoding(10 * tokenize.RELEASE_AFTER_TOKENS)
    assert calls == [0, 0] and release.releases == 2
    release._trim = None  # not glibc: nothing to call, nothing counted
    clock[0] += 60
    release.after_encoding(10 * tokenize.RELEASE_AFTER_TOKENS)
    assert release.releases == 2


def test_the_tokenizer_releases_after_encoding_a_long_prompt(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    class Recorder:
        def after_encoding(self, tokens: int) -> None:
            seen.append(tokens)

    monkeypatch.setattr(tokenize, "_RELEASE", Recorder())
    tok = ModelTokenizer.from_dir(llama_dir)
    rng = random.Random(3)
    ids = tok.completion_ids(_text(rng, 40))
    long_ids = tok.completion_ids(" ".join(rng.choice(WORDS) for _ in range(tokenize.RELEASE_AFTER_TOKENS + 100)))
    assert seen[0] == len(ids) - 1  # the short prompt's one encoding (its BOS is added after)
    assert len(long_ids) > tokenize.RELEASE_AFTER_TOKENS and max(seen) > tokenize.RELEASE_AFTER_TOKENS


@pytest.mark.skipif(not glibc_function("malloc_trim"), reason="glibc's malloc_trim")
def test_glibc_trim_is_found() -> None:
    trim = tokenize._HeapRelease()._trim
    assert trim is not None and trim(0) in (0, 1)
