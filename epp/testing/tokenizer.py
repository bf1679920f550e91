"""A tiny model tokenizer made here in about a second: the test data of :mod:`epp.prefix.tokenize`.

Nothing is downloaded. :func:`train_bpe` trains a byte-level BPE (HF ``tokenizers``) on a generated
corpus of words; ``tests/realvllm/make_model.py`` trains the real-vLLM tier's tokenizer with this same
function (it loads this file by path, since the vLLM virtualenv does not install epp), so the two
vocabularies are the same. :func:`write_tokenizer_dir` writes a model directory as a model repository
ships it: ``tokenizer.json`` (with a post-processor that adds BOS, as Llama's does, or not),
``tokenizer_config.json`` (special tokens, ``add_bos_token`` when asked) and the chat template, in
``tokenizer_config.json`` or in ``chat_template.jinja``.

The templates in :data:`TEMPLATES` exercise what changes token ids: ``bos_token``, a system message
pulled out of the loop, ``raise_exception``, ``tojson`` of tools and tool-call arguments, content
given as a list of parts (which makes vLLM pass parts as dicts instead of joined text), the generation
prompt, whitespace control with ``trim_blocks``/``lstrip_blocks``.

This module imports only the standard library at import time (``tokenizers`` when a function runs),
so that the vLLM virtualenv can load it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["SPECIAL_TOKENS", "TEMPLATES", "WORDS", "corpus", "train_bpe", "write_tokenizer_dir"]

SEED = 1234
"""The seed of the tier's corpus (make_model.py's ``_SEED``)."""

WORDS = [
    "the", "a", "pod", "model", "cache", "token", "request", "prompt", "answer", "server", "route", "pick",
    "queue", "prefix", "adapter", "lora", "envoy", "picker", "score", "filter", "weight", "load", "time",
    "first", "last", "stream", "chunk", "one", "two", "three", "four", "five", "six", "seven", "eight",
    "nine", "ten", "hello", "world", "system", "user", "assistant",
]

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
"""The tier tokenizer's special tokens, ids 0-5 in this order (``<s>`` is BOS, ``</s>`` EOS)."""

CHATML_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
"""Extra special tokens of :func:`write_tokenizer_dir`'s ChatML-style templates."""


def corpus(rng: random.Random) -> list[str]:
    """Lines of words, numbers and punctuation: enough that the BPE fills its vocabulary with merges."""
    lines = []
    for _ in range(4000):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 20))]
        words.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return lines


def train_bpe(
    vocab_size: int = 512, *, seed: int = SEED, special_tokens: tuple[str, ...] = SPECIAL_TOKENS
) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` entries (special tokens first), trained on :func:`corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(random.Random(seed)), trainer=trainer)
    return tok


# --- chat templates --------------------------------------------------------------------------------

_TINY = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Llama-3-like: BOS written by the template, the system message taken out of the loop, roles checked
# with raise_exception, contents trimmed.
_LLAMA = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message %}
{{- '<|system|>\\n' + system_message + '</s>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Conversation roles must be system, user, assistant or tool') }}
    {%- endif %}
    {{- '<|' + message['role'] + '|>\\n' + (message['content'] or '') | trim + '</s>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

# ChatML with tools (Qwen-like): tools as JSON in the system turn, tool calls with their arguments as
# JSON, tool results wrapped; content given as parts is iterated (so vLLM detects the "openai" format).
_CHATML_TOOLS = """{%- macro render_content(content) %}
{%- if content is string %}{{ content }}{% else %}{% for part in content %}{{ part.text }}{% endfor %}{% endif %}
{%- endmacro %}
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ render_content(messages[0].content) }}

{% endif %}tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ render_content(messages[0].content) }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
<|im_start|>{{ message.role }}
{% if message.content is string %}{{ message.content }}{% elif message.content %}
{%- for part in message.content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}
{%- if message.tool_calls %}
{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}
{%- endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

TEMPLATES: dict[str, str] = {"tiny": _TINY, "llama": _LLAMA, "chatml-tools": _CHATML_TOOLS}
"""Chat templates by name: ``tiny`` is the tier model's own."""


def write_tokenizer_dir(
    out: Path,
    *,
    template: str | None = "llama",
    template_file: bool = False,
    add_bos: bool = True,
    add_bos_token: bool | None = None,
    vocab_size: int = 500,
) -> Path:
    """Write a model directory's tokenizer files under ``out`` and return ``out``.

    ``template``: a name of :data:`TEMPLATES`, a template's text, or None (no chat template);
    ``template_file``: write it to ``chat_template.jinja`` rather than into ``tokenizer_config.json``;
    ``add_bos``: ``tokenizer.json``'s post-processor adds ``<s>`` to every encoded text (Llama's);
    ``add_bos_token``: write that flag into ``tokenizer_config.json`` (transformers then rebuilds the
    post-processor from it). The vocabulary is :func:`train_bpe`'s plus :data:`CHATML_TOKENS`:
    ``vocab_size`` + 4 entries (504 by default, within the tier model's 512 embeddings).
    """
    from tokenizers import AddedToken, processors

    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(vocab_size)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_TOKENS])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    text = TEMPLATES.get(template, template) if template is not None else None
    if text is not None and template_file:
        (out / "chat_template.jinja").write_text(text)
    elif text is not None:
        config["chat_template"] = text
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
