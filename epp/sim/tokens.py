"""A deterministic stand-in tokeniser, chat template and synthetic output generator.

What is simulated
-----------------
* **Tokens.** One token is 4 bytes of UTF-8 text (OpenAI's rule of thumb is ~4 characters of English per
  token). The id of a token is a 32-bit mix of those 4 bytes, computed for the whole prompt at once with numpy
  (a 400 KB prompt tokenises in well under a millisecond). Equal text gives equal ids, so two prompts that
  share a prefix share token ids up to the last whole 4-byte chunk of the common prefix, which is what the
  prefix cache needs. A completions prompt is ``[BOS] + tokens(prompt)``.
* **Chat template.** Each message is rendered as ``<start_header> role <end_header> content <eot>`` around
  ``[BOS]``, followed by the generation prompt ``<start_header> assistant <end_header>`` (the shape of the
  Llama 3 template). Each message's content is tokenised on its own, as a real tokeniser restarts at the
  template's special tokens.
* **Output.** Generated text is a sequence of 4-byte words (three letters and a space, the last word ends
  with a full stop instead), one word per token. Tokenising that text gives back exactly the generated token
  ids, so a follow-up chat turn that quotes the assistant's answer hits the KV blocks cached for it, as it does
  on vLLM. The words and the number of tokens are a pure function of (seed, model, prompt, max_tokens,
  ignore_eos): the same request gives the same answer on any pod, in any order.
* **The served model's own tokenizer instead** (``python -m epp.sim --tokenizer DIR``,
  ``EngineConfig.tokenizer``): prompts are tokenized by :mod:`epp.prefix.tokenize` from the model
  directory's ``tokenizer.json`` and chat template, exactly as the picker's precise producer computes
  them (so the precise path can be exercised against the simulator): :func:`model_prompts`. Output
  words stay the 4-byte ones above, so a reply quoted back re-tokenizes differently from the ids the
  pod generated (as it can on vLLM too); prompts of the same text still share their ids.
* **The same tokenization as a model's files** (:func:`write_model_files`): a ``tokenizer.json``
  (a 4-character split, a word-level vocabulary numbered with the ids above, BOS added to a
  completion) and a chat template that give exactly the ids above for text made of the generated
  words (three letters and a space or a full stop, the benches' prompts and the pods' own answers),
  so that a picker can tokenize locally what a default simulator computes: the precise producer's
  ``local.autoDiscoveryDir`` pointed at them. Any other 4 characters are one unknown token there,
  which only costs a lookup its match.
* **Length.** Unless ``ignore_eos`` is set, the model emits end-of-sequence with a fixed probability
  ``1 / mean_output_tokens`` per token (a geometric length); the request stops at ``max_tokens`` otherwise.
"""

from __future__ import annotations

import itertools
import json
import string
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash

from epp.prefix.tokenize import ModelTokenizer, TemplateError, Unsupported

__all__ = [
    "BYTES_PER_TOKEN", "OutputPlan", "model_prompts", "model_tokenizer", "plan_output", "render_chat",
    "render_completion", "tokenize", "write_model_files",
]  # fmt: skip

BYTES_PER_TOKEN = 4
"""Bytes of UTF-8 text per token: the ~4 characters per token rule of thumb for English."""


def _fmix32(x: np.ndarray) -> np.ndarray:
    # MurmurHash3's 32-bit finaliser: a cheap bijection with good avalanche, so ids look random.
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def tokenize(text: str) -> np.ndarray:
    """Token ids (``uint32``) of ``text``: one id per 4 bytes of UTF-8, the last chunk zero-padded."""
    data = text.encode("utf-8")
    pad = -len(data) % BYTES_PER_TOKEN
    if pad:
        data += b"\0" * pad
    return _fmix32(np.frombuffer(data, dtype="<u4"))


def _special(name: str) -> int:
    return xxhash.xxh32_intdigest(name.encode())


_BOS = _special("<|begin_of_text|>")
_START_HEADER = _special("<|start_header_id|>")
_END_HEADER = _special("<|end_header_id|>")
_EOT = _special("<|eot_id|>")


def render_completion(prompt: str) -> np.ndarray:
    """Prompt token ids of a completions request: BOS, then the prompt's tokens."""
    return np.concatenate((np.array([_BOS], dtype=np.uint32), tokenize(prompt)))


def _header(role: str) -> np.ndarray:
    return np.concatenate(
        (np.array([_START_HEADER], dtype=np.uint32), tokenize(role), np.array([_END_HEADER], dtype=np.uint32))
    )


def render_chat(messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True) -> np.ndarray:
    """Prompt token ids of a chat request, from ``(role, content)`` pairs, ending in the generation prompt
    unless ``add_generation_prompt`` is false (``/tokenize``'s option of that name)."""
    parts = [np.array([_BOS], dtype=np.uint32)]
    eot = np.array([_EOT], dtype=np.uint32)
    for role, content in messages:
        parts += (_header(role), tokenize(content), eot)
    if add_generation_prompt:
        parts.append(_header("assistant"))
    return np.concatenate(parts)


@lru_cache(maxsize=8)
def model_tokenizer(directory: str) -> ModelTokenizer:
    """The served model's tokenizer, loaded once per process (pods of one process share it and its
    prefix cache); :class:`epp.prefix.tokenize.TokenizerError` names the file at fault."""
    return ModelTokenizer.from_dir(directory)


class _Prompts(msgspec.Struct):
    prompt: Any = None
    add_special_tokens: bool = True


def model_prompts(directory: str, api: str, body: bytes) -> list[np.ndarray]:
    """Prompt token ids of a request body through the model's tokenizer: one array per prompt (a
    completions list of strings gives one each, as vLLM runs them). ValueError says why not."""
    tokenizer = model_tokenizer(directory)
    try:
        if api == "completions":
            prompts = msgspec.json.decode(body, type=_Prompts)
            if isinstance(prompts.prompt, list) and len(prompts.prompt) > 1 and all(
                isinstance(p, str) for p in prompts.prompt
            ):
                add = prompts.add_special_tokens
                return [tokenizer.completion_ids(p, add_special_tokens=add) for p in prompts.prompt]
        return [tokenizer.request_ids(api, body)]
    except (Unsupported, TemplateError, msgspec.DecodeError) as exc:
        raise ValueError(f"the model's tokenizer cannot take this request: {exc}") from exc


# Every three-letter lowercase word: 26**3 = 17,576 output "tokens", each 4 bytes with its separator.
_STEMS = tuple("".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=3))
_WORDS = tuple(s + " " for s in _STEMS)
_LAST_WORDS = tuple(s + "." for s in _STEMS)
_WORD_IDS = tokenize("".join(_WORDS))
_LAST_WORD_IDS = tokenize("".join(_LAST_WORDS))


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What a request will generate: one word and one token id per output token, and why it stops."""

    words: tuple[str, ...]
    token_ids: np.ndarray
    finish_reason: str  # "stop" (end-of-sequence) or "length" (max_tokens reached)


def plan_output(
    prompt_ids: np.ndarray, *, model: str, seed: int, max_tokens: int, ignore_eos: bool, mean_output_tokens: int
) -> OutputPlan:
    """The deterministic output of a request (see the module docstring for the model)."""
    key = xxhash.xxh3_64_intdigest(prompt_ids.tobytes(), seed=xxhash.xxh3_64_intdigest(model.encode()))
    rng = np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, key])
    natural = max_tokens if ignore_eos else int(rng.geometric(1.0 / max(mean_output_tokens, 1)))
    n = min(natural, max_tokens)
    idx = rng.integers(0, len(_STEMS), size=n)
    last = int(idx[-1])
    words = [_WORDS[i] for i in idx[:-1].tolist()]
    words.append(_LAST_WORDS[last])
    token_ids = _WORD_IDS[idx]
    token_ids[-1] = _LAST_WORD_IDS[last]
    stopped = not ignore_eos and natural <= max_tokens
    return OutputPlan(tuple(words), token_ids, "stop" if stopped else "length")


_ROLES = ("system", "user", "assistant", "tool", "developer")
_UNKNOWN = "<|unknown|>"
_SPECIALS = {
    "<|begin_of_text|>": _BOS, "<|start_header_id|>": _START_HEADER, "<|end_header_id|>": _END_HEADER,
    "<|eot_id|>": _EOT,
}  # fmt: skip
_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)


def write_model_files(directory: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) that tokenize
    as this module does (see the module docstring) into ``directory``; return its path.

    The vocabulary's ids are this module's 32-bit ids, which HF ``tokenizers`` accepts but serializes
    slowly (it walks every id up to the largest), so the file is written from its JSON layout: a
    layout that :meth:`tokenizers.Tokenizer.from_file` reads back, which the tests check.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, processors

    vocab: dict[str, int] = {_UNKNOWN: _special(_UNKNOWN)}
    for text, ids in ((_WORDS, _WORD_IDS), (_LAST_WORDS, _LAST_WORD_IDS)):
        vocab.update(zip(text, ids.tolist(), strict=True))
    for role in _ROLES:  # a role is tokenized on its own, between header tokens: its last piece padded
        pieces = [role[i : i + BYTES_PER_TOKEN] for i in range(0, len(role), BYTES_PER_TOKEN)]
        vocab.update(zip(pieces, tokenize(role).tolist(), strict=True))
    # The pipeline is built by the library with a stand-in vocabulary (its JSON layout is the
    # library's), then given the real vocabulary and ids.
    tok = Tokenizer(models.WordLevel(vocab={_UNKNOWN: 0}, unk_token=_UNKNOWN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]{1,4}"), behavior="isolated")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, _BOS)])
    layout = json.loads(tok.to_str())
    for added in layout["added_tokens"]:
        added["id"] = _SPECIALS[added["content"]]
    layout["model"]["vocab"] = vocab | _SPECIALS
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(layout), encoding="utf-8")
    config = {
        "bos_token": bos, "eos_token": "<|eot_id|>", "unk_token": _UNKNOWN, "chat_template": _TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return out
