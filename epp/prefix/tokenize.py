"""Prompt token ids from the served model's own tokenizer files, as vLLM 0.32 computes them.

The precise prefix index (:mod:`epp.prefix.kvindex`) is looked up by the token ids the engine will
compute for a request; this module computes them from the model's files in a local directory (or a
mounted ConfigMap), never downloading anything.

API (small on purpose; the simulator and the benches use it as the producer does)::

    tok = ModelTokenizer.from_dir("/models/llama")        # TokenizerError names the file at fault
    ids = tok.request_ids("chat_completions", body_bytes)  # np.ndarray[uint32]: the engine's prompt ids
    ids = tok.chat_ids(messages, ChatOptions(...))         # a chat request's, from its parsed messages
    ids = tok.completion_ids("text")                        # a completions prompt's (BOS as the model adds it)
    plan = tok.plan("chat_completions", body_bytes)         # all but the encoding: plan.known (the start reused
    ids = plan.finish()                                     #   from the cache, or None), plan.pending (bytes left)
    tok.stats()                                             # counters: cache hits, tokens reused, audits...

``request_ids`` raises :class:`Unsupported` for what it cannot reproduce exactly (multimodal
content, ``prompt_embeds``, a template it cannot resolve...) and :class:`epp.prefix.chat.TemplateError`
where vLLM answers 400; the producer then falls back (see ``precise-prefix-cache-producer``).

Files read (transformers 5's loading rules, as the engine's tokenizer sees them)
--------------------------------------------------------------------------------
``tokenizer.json`` (required; run by HF ``tokenizers``, the Rust library transformers wraps);
``tokenizer_config.json``: the special tokens (``bos_token``... and any other ``*_token``, a string or
an AddedToken object; ``special_tokens_map.json`` too when the config has no ``added_tokens_decoder``),
added to the vocabulary when missing, and ``add_bos_token``/``add_eos_token``: when either is given,
the post-processor is rebuilt as ``[BOS] $A [EOS]`` with those flags, as transformers does; the
chat template: ``chat_template.jinja`` (and ``additional_chat_templates/*.jinja``, named) win over
the config's ``chat_template`` (a string, or a list of ``{name, template}``). Not reproduced: the
tokenizer classes of transformers 5 that rebuild their pipeline from the vocabulary (a class's own
defaults, e.g. a ``LlamaTokenizer`` that adds BOS without saying so), sentencepiece-only and Mistral
(``tekken.json``) tokenizers.

Token rules (vLLM 0.32)
-----------------------
*Completions*: the prompt (a string, the first of a list of strings: the engine runs each prompt as its
own sequence, and the request goes to one pod, so the first is what a lookup can use; token ids
given as a list, or the first of a list of lists, are used as they are) is encoded with
``add_special_tokens`` (default true: the post-processor's BOS). *Chat*: the messages are rendered
by :mod:`epp.prefix.chat` to text, which is encoded with ``add_special_tokens`` (default *false*: a
template that writes ``{{ bos_token }}`` gets one BOS; a request that sets it true gets a second one,
as vLLM does). ``kv_transfer_params.prompt_token_ids`` of a text-only chat request without ``echo``
are used as they are, as vLLM does. ``truncate_prompt_tokens`` = k: with ``truncation_side`` given,
the ids are cut to their last (``left``) or first (``right``) k; without, as the tokenizer truncates
(left, in vLLM): the text's tokens are cut to their last k minus the tokens the post-processor adds,
which it then adds. ``-1`` (the model's length) is :class:`Unsupported` (this module does not know it).

Reuse of stable prefixes (a long conversation is not re-tokenized each turn)
----------------------------------------------------------------------------
The tokenizer splits text at its added tokens (``<|im_end|>``, ``<|eot_id|>``...) before
anything else, and tokenizes the pieces between them independently: so the ids of a text are the
ids of its prefix through an added token, followed by the ids of the rest *starting with that
token* minus that first id. At load, each added token (not normalized) is checked to behave so on
probe strings (whitespace, accents, newlines around it: a token with ``lstrip``/``rstrip`` or a
normalizer that does not keep to its piece fails, and is never cut at); only those that pass are
*cut points*.

The cache maps ``xxh3_128(text[:c])`` (the UTF-8 text through a cut point ``c``) to the ids of
that prefix (a view into one shared array per tokenized text), in an LRU bounded in bytes
(``cache_bytes``). A request's text is rendered whole (the template sees the whole conversation, so
whether the first k messages render to a prefix of it is never assumed: a prefix hit *is* that
check); its last 32 cut points (found in a window at the text's end, their digests from one pass
over it) then its first 8 are probed, longest first; on a hit at cut ``c`` after
token ``t`` (starting at ``a``), only ``text[a:]`` is encoded, and it must start with ``t`` (else the
text is encoded whole, counted in ``unstable``). After tokenizing, entries are added at the text's
first 8 and last 4 cut points (a hit adds only those after it), each mapped to its token by counting
cut-point tokens in the ids (a count that does not match the text's cut points adds nothing:
``unmapped``); the entries of the array a hit extended are moved onto the new array, so a
conversation keeps one array, not one per turn. One warm request in ``audit_every`` is also
tokenized whole (:meth:`ModelTokenizer.pop_audit` hands it to the caller's thread pool): a
difference turns the reuse off for this tokenizer and is counted (``audit_mismatches``).

Completions prompts reuse the same cache when they contain added tokens (a pre-rendered chat); plain
text has no cut points and is tokenized whole each time.

A cold prompt's head
--------------------
A prompt the cache has nothing of (or under :data:`_HEAD_TOKENS` of: every chat shares its first
token or two) still says something before it is encoded whole: its *head*, the text's first 512
bytes cut at their last space, encoded alone, its last :data:`_HEAD_MARGIN` ids dropped, becomes the
plan's ``known`` start, with ``Plan.head`` set. Pre-tokenizers split text at whitespace and BPE
merges stay inside the pieces, so ids far from the cut are the whole's; the caller checks that
they are once it has the whole (the precise producer counts a difference). What the head is for: a
precise lookup needs a prompt's first block before anything else (keys are chained), and when no
pod holds that block, no pod holds any of the prompt, which the whole encoding would only confirm
(:mod:`epp.plugins.producer.precise_prefix_cache`, "A cold prompt's head"). Only prompts of
:data:`_HEAD_MIN_BYTES` or more get a head (shorter ones cost less to encode than a head and a
second lookup), and only when the head's second half has a space (a long word, or a script written
without spaces, gets none).

Memory after a long prompt
--------------------------
HF tokenizers allocates per word while it encodes (a pre-tokenizer split: its strings and
alignments) and frees it all before it returns; glibc keeps what was freed in its heaps, resident,
for later allocations. One 100k-token prompt left the tokenizing process ~23 MiB larger for good,
whatever glibc's thresholds: ``python bench/malloc_policy.py --requests 400 --rounds 3 --policies
arenas2,picker,fixed:1024:2048`` (400 prompts of the soak's mix, the long prompt and 400 more, then
400 more again; RSS by round), 2 arenas as before this release: 102.3 / 102.3 / 98.3 MiB -> 127.3 /
127.3 / 120.7 -> the same; with glibc's mmap and trim thresholds fixed at 1 and 2 MiB: 97.2 / 97.2 /
92.3 -> 119.8 / 119.9 / 116.0 -> the same. The resident size of a picker that tokenizes was its
largest prompt's, and one such prompt was enough. So after an encoding of more than
:data:`RELEASE_AFTER_TOKENS` tokens, on the thread that encoded it, glibc is asked to give its heaps'
free pages back (``malloc_trim(0)``), at most once per :data:`RELEASE_EVERY_SECONDS` (long prompts
in a row reuse what the last one freed): in the same run 102.2 / 103.2 / 99.2 -> 104.3 / 105.6 /
97.6 -> 105.3 / 106.6 / 97.9 MiB, one trim a run of at most 2.5 ms, against ~0.5-1 s of CPU to
encode that prompt on that machine; the mix's CPU a request 10.3-11.7 ms under every policy (the
picker's as high before its trim as after: the machine's scatter). A trim
holds the heaps' locks while it runs, which is why it is neither periodic nor done after every prompt
(``epp.server.process``'s docstring measured a periodic one). Not on glibc, nothing is done.

Costs (``python bench/tokenize_cost.py``, CPU, 2 shared cores): a cold 100k-token prompt ~150-170 ms
(HF tokenizers, ~1.5 µs a token; off the event loop, on the producer's threads); a warm 100k-token
conversation turn 2.8-3.8 ms (decoding 0.5, rendering 0.2-1.6 by template, lookup 0.2, encoding
the ~1% new tokens ~1.2); the script's docstring has the whole table.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash
from tokenizers import AddedToken, Tokenizer, processors

from epp._libc import glibc_function
from epp.prefix.chat import ChatOptions, ChatTemplate, TemplateError, Unsupported, render_chat

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "RELEASE_AFTER_TOKENS",
    "RELEASE_EVERY_SECONDS",
    "ChatOptions",
    "ModelTokenizer",
    "Plan",
    "TemplateError",
    "TokenizeStats",
    "TokenizerError",
    "Unsupported",
]

DEFAULT_CACHE_BYTES = 128 << 20
"""128 MiB of cached prefix ids: 32M tokens, some 300 conversations of 100k tokens."""

RELEASE_AFTER_TOKENS = 65_536
"""An encoding of more tokens than this is followed by a release of the heaps' free pages (see
"Memory after a long prompt")."""
RELEASE_EVERY_SECONDS = 10.0
"""At most one release in this many seconds: long prompts in a row reuse what the last one freed."""


class _HeapRelease:
    """``malloc_trim(0)`` after long encodings, rate-limited; nothing where the C library has none."""

    def __init__(self, every: float = RELEASE_EVERY_SECONDS) -> None:
        self._trim = glibc_function("malloc_trim")
        self._every = every
        self._lock = threading.Lock()
        self._last = -every
        self.releases = 0

    def after_encoding(self, tokens: int) -> None:
        if tokens <= RELEASE_AFTER_TOKENS or self._trim is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._every:
                return
            self._last = now
            self.releases += 1
        self._trim(0)


_RELEASE = _HeapRelease()

_SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_PROBE_LAST = 32  # cut points probed from the end: a new turn adds a handful
_PROBE_FIRST = 8  # and from the start: a system prompt shared by many conversations
_INSERT_LAST = 4
_INSERT_FIRST = 8
_HEAD_BYTES = 512  # a cold prompt's head: its first bytes up to the last space among them
_HEAD_MIN_BYTES = 2048  # shorter prompts cost less to encode than a head and a second lookup
_HEAD_MARGIN = 8  # the head's last ids, near its cut, are not used
_HEAD_TOKENS = 32  # nor a head (or a reused prefix, for this purpose) of fewer ids than that
_ENTRY_BYTES = 200  # an entry's own bookkeeping (dict slot, key, object), counted against the bound
_DOC_BYTES = 100
_AUDIT_EVERY = 64
_DENSE_IDS = 1 << 22  # token ids below this are looked up in a table (4 MiB at most)
_TEXT_TYPES = (None, "text", "input_text", "output_text", "refusal", "thinking")
_PROBE_LEFT = ("hello world", "a\n", "  ", "é")
_PROBE_RIGHT = (" there", "\nnext", "x", "  y", "é", "\n\n", "")


class TokenizerError(Exception):
    """The tokenizer files cannot be used; the message names the file."""


@dataclass
class TokenizeStats:
    """Counters since start (read by the producer's metrics)."""

    requests: int = 0
    encoded_tokens: int = 0  # tokens the Rust tokenizer produced
    reused_tokens: int = 0  # tokens taken from the cache instead
    cache_hits: int = 0
    unstable: int = 0
    unmapped: int = 0
    audits: int = 0
    audit_mismatches: int = 0
    cache_bytes: int = 0
    cache_entries: int = 0


# --- request bodies: only what changes the prompt's ids -------------------------------------------


class _CompletionBody(msgspec.Struct):
    prompt: Any = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None


class _ChatBody(msgspec.Struct):
    messages: list[Any] = []
    tools: list[Any] | None = None
    documents: list[Any] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    reasoning_effort: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    echo: bool = False


_DECODE_COMPLETION = msgspec.json.Decoder(_CompletionBody).decode
_DECODE_CHAT = msgspec.json.Decoder(_ChatBody).decode


# --- the prefix cache -----------------------------------------------------------------------------


class _Doc:
    __slots__ = ("entries", "ids")

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self.entries: list[_Entry] = []


class _Entry:
    __slots__ = ("doc", "key", "ntok")

    def __init__(self, key: int, doc: _Doc, ntok: int) -> None:
        self.key = key
        self.doc = doc
        self.ntok = ntok


class _PrefixCache:
    """digest of a text prefix -> its ids, LRU, bounded in bytes; thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: int) -> tuple[_Doc, int] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.doc, entry.ntok

    def put(self, doc: _Doc, marks: Sequence[tuple[int, int]], extends: tuple[_Doc, int] | None = None) -> None:
        """Entries ``(key, ntok)`` on ``doc``. ``extends``: an earlier doc and how many of its first ids
        ``doc`` repeats; its entries within those move onto ``doc``, so that it can be freed."""
        if self.capacity <= 0:
            return
        with self._lock:
            for key, ntok in marks:
                old = self._entries.pop(key, None)
                if old is not None:
                    self._unlink(old)
                self._link(_Entry(key, doc, ntok))
            if extends is not None and extends[0] is not doc:
                old_doc, limit = extends
                for entry in [e for e in old_doc.entries if e.ntok <= limit]:
                    self._unlink(entry)
                    entry.doc = doc
                    self._link(entry)
            while self.bytes > self.capacity and self._entries:
                _, oldest = self._entries.popitem(last=False)
                self._unlink(oldest)

    def _link(self, entry: _Entry) -> None:
        doc = entry.doc
        if not doc.entries:
            self.bytes += doc.ids.nbytes + _DOC_BYTES
        doc.entries.append(entry)
        self._entries[entry.key] = entry
        self.bytes += _ENTRY_BYTES

    def _unlink(self, entry: _Entry) -> None:
        """Take ``entry`` off its doc (the caller has taken it out of the map, or re-links it)."""
        doc = entry.doc
        doc.entries.remove(entry)
        self.bytes -= _ENTRY_BYTES
        if not doc.entries:
            self.bytes -= doc.ids.nbytes + _DOC_BYTES

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


# --- the tokenizer --------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise TokenizerError(f"{path}: {exc}") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: not a JSON object")
    return value


def _templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    jinja = directory / "chat_template.jinja"
    extra = directory / "additional_chat_templates"
    try:
        if jinja.is_file():
            templates["default"] = jinja.read_text(encoding="utf-8")
        if extra.is_dir():
            for file in sorted(extra.glob("*.jinja")):
                templates[file.stem] = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{directory}: cannot read a chat template: {exc}") from exc
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for item in value:
            name, text = (item.get("name"), item.get("template")) if isinstance(item, dict) else (None, None)
            if not isinstance(name, str) or not isinstance(text, str):
                where = directory / "tokenizer_config.json"
                raise TokenizerError(f"{where}: chat_template items need a name and a template")
            templates[name] = text
        return templates
    if value is not None:
        raise TokenizerError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string or a list")
    return {}


class ModelTokenizer:
    """One model's tokenizer and chat template, with the prefix cache (thread-safe)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat: ChatTemplate,
        *,
        name: str = "",
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        audit_every: int = _AUDIT_EVERY,
    ) -> None:
        self.name = name
        self.chat = chat
        self._tok = tokenizer
        self._cache = _PrefixCache(cache_bytes)
        self._stats = TokenizeStats()
        self._stats_lock = threading.Lock()
        self._audit_every = audit_every
        self._warm = 0
        self._audit: tuple[str, np.ndarray] | None = None
        self._incremental = True
        probe = self._tok.encode("hello", add_special_tokens=False).ids
        full = self._tok.encode("hello", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(probe) + 1) if full[i : i + len(probe)] == probe), None)
        if at is None:
            raise TokenizerError(f"{name or 'tokenizer'}: its post-processor changes the text's own tokens")
        self._head = np.array(full[:at], dtype=np.uint32)  # what add_special_tokens puts around a text
        self._tail = np.array(full[at + len(probe) :], dtype=np.uint32)
        self._cut_ids: dict[bytes, int] = self._stable_cut_points()
        # Where the cut-point tokens are in a text's ids: a lookup table over the vocabulary's ids when
        # they are dense (every real model's), else a comparison with each (a hand-made vocabulary
        # may number its tokens anywhere in uint32, e.g. the simulator's own: epp.sim.tokens).
        largest = max(self._tok.get_vocab(with_added_tokens=True).values(), default=0)
        self._cut_array = np.array(sorted(self._cut_ids.values()), dtype=np.uint32)
        self._cut_mask: np.ndarray | None = None
        if largest < _DENSE_IDS:
            self._cut_mask = np.zeros(largest + 1, dtype=bool)
            self._cut_mask[self._cut_array] = True
        ordered = sorted(self._cut_ids, key=len, reverse=True)  # longest first: leftmost-longest matching
        self._cuts = re.compile(b"|".join(re.escape(t) for t in ordered)) if ordered else None

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_dir(
        cls,
        directory: str | Path,
        *,
        chat_template: str | None = None,
        name: str = "",
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        tokenizer_file: str = "tokenizer.json",
    ) -> ModelTokenizer:
        """Load ``directory``'s tokenizer files (see the module docstring); ``chat_template``: the
        server's ``--chat-template`` (a template's text, or a file holding one)."""
        path = Path(directory)
        file = path / tokenizer_file
        if not file.is_file():
            raise TokenizerError(f"{file}: no such file (a model directory with {tokenizer_file} is needed)")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust library's errors are plain Exceptions
            raise TokenizerError(f"{file}: {exc}") from exc
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        specials: dict[str, str] = {}
        for key, value in config.items():
            text = _token_text(value)
            if text is not None and (key in _SPECIAL_ATTRIBUTES or key.endswith("_token")):
                specials[key] = text
        legacy = path / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and legacy.is_file():
            for key, value in _read_json(legacy).items():
                text = _token_text(value)
                if text is not None and key.endswith("_token"):
                    specials[key] = text
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        missing = [t for t in specials.values() if t not in vocab]
        if missing:
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        if "add_bos_token" in config or "add_eos_token" in config or tokenizer.post_processor is None:
            bos, eos = bool(config.get("add_bos_token")), bool(config.get("add_eos_token"))
            _rebuild_post_processor(tokenizer, specials, bos, eos)
        server = None
        if chat_template is not None:
            candidate = Path(chat_template)
            try:
                server = candidate.read_text(encoding="utf-8") if candidate.is_file() else chat_template
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{candidate}: {exc}") from exc
        template = ChatTemplate(_templates(path, config), specials, server)
        return cls(tokenizer, template, name=name or path.name, cache_bytes=cache_bytes)

    def _stable_cut_points(self) -> dict[bytes, int]:
        """The added tokens a text may be cut after (see the module docstring), by UTF-8 text."""
        stable: dict[bytes, int] = {}
        for token_id, token in self._tok.get_added_tokens_decoder().items():
            if token.normalized or not token.content:
                continue
            t = token.content
            if all(self._splits_at(left, t, right, token_id) for left in _PROBE_LEFT for right in _PROBE_RIGHT):
                stable[t.encode()] = token_id
        return stable

    def _splits_at(self, left: str, token: str, right: str, token_id: int) -> bool:
        encode = self._tok.encode
        head = encode(left + token, add_special_tokens=False).ids
        rest = encode(token + right, add_special_tokens=False).ids
        whole = encode(left + token + right, add_special_tokens=False).ids
        return bool(head) and head[-1] == token_id and bool(rest) and rest[0] == token_id and whole == head + rest[1:]

    # -- encoding --------------------------------------------------------------------------------

    def _encode(self, text: str) -> np.ndarray:
        try:
            ids = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        except Exception as exc:  # e.g. a lone surrogate the Rust side cannot take
            raise Unsupported(f"the tokenizer refused the text: {exc}") from exc
        with self._stats_lock:
            self._stats.encoded_tokens += len(ids)
        array = np.array(ids, dtype=np.uint32)
        del ids  # before a release: the list and its ints are freed too (the Rust side's buffers already are)
        _RELEASE.after_encoding(len(array))
        return array

    def content_ids(self, text: str) -> np.ndarray:
        """The ids of ``text`` without the post-processor's special tokens, reusing cached prefixes."""
        return self._content_plan(text).finish()

    def _content_plan(self, text: str) -> Plan:
        with self._stats_lock:
            self._stats.requests += 1
        cuts = self._cuts
        data = text.encode("utf-8", "surrogatepass")
        if cuts is None or not self._incremental or self._cache.capacity <= 0:
            return self._with_head(Plan(len(data), lambda: self._encode(text)), data)
        view = memoryview(data)
        # The last cut points first, found in a window at the end (a new turn adds a handful): a warm
        # request never scans the whole text. Their digests come from one pass over the text.
        tail = self._tail_marks(data)
        if not tail:
            return self._with_head(Plan(len(data), lambda: self._encode(text)), data)
        digests = _digests(view, [end for _, end in tail])
        for i in range(len(tail) - 1, -1, -1):
            found = self._usable(digests[i])
            if found is not None:
                return self._warm_plan(text, data, tail, (i, *found), digests)
        # Then the first cut points (a system prompt that other conversations share), then none.
        marks = [(m.start(), m.end()) for m in cuts.finditer(data)]
        for i in range(min(_PROBE_FIRST, len(marks)) - 1, -1, -1):
            found = self._usable(xxhash.xxh3_128_intdigest(view[: marks[i][1]]))
            if found is not None:
                return self._warm_plan(text, data, marks, (i, *found), None)
        return self._with_head(Plan(len(data), lambda: self._whole(text, data, marks)), data)

    def _with_head(self, plan: Plan, data: bytes) -> Plan:
        """``plan`` with its text's head as its known start (see "A cold prompt's head"), when the text
        is long enough to be worth it and its head splits at a space into enough tokens."""
        if len(data) < _HEAD_MIN_BYTES:
            return plan
        window = data[:_HEAD_BYTES]
        cut = max(window.rfind(b" "), window.rfind(b"\n"))
        if cut < _HEAD_BYTES // 2:
            return plan  # no space in the head's second half: a long word, or a script written without
        ids = self._encode(window[:cut].decode("utf-8", "surrogatepass"))  # (an ASCII byte: a boundary)
        kept = ids[: len(ids) - _HEAD_MARGIN]
        if len(kept) < _HEAD_TOKENS:
            return plan
        plan.known, plan.estimated, plan.head = kept, round(len(data) * len(ids) / cut), True
        return plan

    def _warm_plan(
        self, text: str, data: bytes, marks: list[tuple[int, int]], hit: tuple[int, _Doc, int], digests: _Digests
    ) -> Plan:
        index, doc, ntok = hit
        through = marks[index][1]  # the reused prefix's bytes, its cut token included
        estimated = ntok + round((len(data) - through) * ntok / through)
        plan = Plan(len(data) - marks[index][0], lambda: self._extend(text, data, marks, hit, digests),
                    doc.ids[:ntok], estimated)  # fmt: skip
        return plan if ntok >= _HEAD_TOKENS else self._with_head(plan, data)  # (a shared first token or so)

    def _tail_marks(self, data: bytes) -> list[tuple[int, int]]:
        """The cut points of the text's last window holding more than :data:`_PROBE_LAST` of them (or of
        the whole text), in order."""
        assert self._cuts is not None
        window = 16 << 10
        while True:
            start = max(0, len(data) - window)
            marks = [(m.start(), m.end()) for m in self._cuts.finditer(data, start)]
            if start == 0:
                return marks
            marks = marks[1:]  # the first may be the tail of a token cut by the window's edge
            if len(marks) > _PROBE_LAST:
                return marks[-_PROBE_LAST:] if len(marks) > 2 * _PROBE_LAST else marks
            window *= 4

    def _usable(self, digest: int) -> tuple[_Doc, int] | None:
        found = self._cache.get(digest)
        return found if found is not None and 0 < found[1] <= len(found[0].ids) else None

    def _whole(self, text: str, data: bytes, marks: list[tuple[int, int]] | None = None) -> np.ndarray:
        ids = self._encode(text)
        if marks is None:
            assert self._cuts is not None
            marks = [(m.start(), m.end()) for m in self._cuts.finditer(data)]
        self._remember(data, marks, ids, 0, None)
        return ids

    def _extend(
        self,
        text: str,
        data: bytes,
        marks: list[tuple[int, int]],
        hit: tuple[int, _Doc, int],
        digests: list[int] | None,
    ) -> np.ndarray:
        """``marks`` run from some cut point through the text's last one (not necessarily from the first)."""
        index, doc, ntok = hit
        rest = self._encode(data[marks[index][0] :].decode("utf-8", "surrogatepass"))
        if not len(rest) or rest[0] != doc.ids[ntok - 1]:
            with self._stats_lock:
                self._stats.unstable += 1
            return self._whole(text, data)
        ids = np.concatenate((doc.ids[:ntok], rest[1:]))
        with self._stats_lock:
            self._stats.cache_hits += 1
            self._stats.reused_tokens += ntok
            self._warm += 1
            if self._audit_every and self._warm % self._audit_every == 0:
                self._audit = (text, ids)
        self._remember(data, marks, ids, index, (doc, ntok), digests)
        return ids

    def _remember(
        self,
        data: bytes,
        marks: list[tuple[int, int]],
        ids: np.ndarray,
        first: int,
        hit: tuple[_Doc, int] | None,
        digests: list[int] | None = None,
    ) -> None:
        """Add cache entries at chosen cut points of ``data`` mapped to their place in ``ids``.

        Cold (``hit`` None): cut-point tokens in ``ids`` map to ``marks`` one to one. After a hit at
        mark ``first`` (its token at ``ntok - 1``), those from that token on map to ``marks[first:]``.
        """
        count = len(marks)
        if hit is None:
            start, chosen = 0, sorted({*range(max(count - _INSERT_LAST, 0), count), *range(min(_INSERT_FIRST, count))})
        else:
            start, chosen = hit[1] - 1, list(range(max(count - _INSERT_LAST, first + 1), count))
        tail = ids[start:]
        hits = self._cut_mask[tail] if self._cut_mask is not None else np.isin(tail, self._cut_array)
        positions = start + np.flatnonzero(hits)
        if len(positions) != count - first:
            with self._stats_lock:
                self._stats.unmapped += 1
            return
        view = memoryview(data)
        out = []
        for i in chosen:
            at = int(positions[i - first])
            if int(ids[at]) != self._cut_ids.get(bytes(view[marks[i][0] : marks[i][1]]), -1):
                with self._stats_lock:
                    self._stats.unmapped += 1
                return
            digest = digests[i] if digests is not None else xxhash.xxh3_128_intdigest(view[: marks[i][1]])
            out.append((digest, at + 1))
        if out or hit is not None:
            self._cache.put(_Doc(ids), out, hit)

    def pop_audit(self) -> tuple[str, np.ndarray] | None:
        """A warm result to check against a whole tokenization (run :meth:`audit` on it), if one is due."""
        with self._stats_lock:
            due, self._audit = self._audit, None
        return due

    def audit(self, text: str, ids: np.ndarray) -> bool:
        """Tokenize ``text`` whole and compare with ``ids``; a difference turns prefix reuse off."""
        whole = self._encode(text)
        same = len(whole) == len(ids) and bool(np.array_equal(whole, ids))
        with self._stats_lock:
            self._stats.audits += 1
            if not same:
                self._stats.audit_mismatches += 1
                self._incremental = False
        if not same:
            self._cache.clear()
        return same

    def stats(self) -> TokenizeStats:
        with self._stats_lock:
            out = TokenizeStats(**{k: getattr(self._stats, k) for k in TokenizeStats.__dataclass_fields__})
        out.cache_bytes, out.cache_entries = self._cache.bytes, len(self._cache)
        return out

    @property
    def backend(self) -> Tokenizer:
        """The HF ``tokenizers`` object (after the loading rules; not to be changed)."""
        return self._tok

    @property
    def incremental(self) -> bool:
        """Whether prefix reuse is on (an audit mismatch turns it off)."""
        return self._incremental

    # -- what a request's prompt is ----------------------------------------------------------------

    def _with_specials(self, content: np.ndarray, add_special_tokens: bool) -> np.ndarray:
        if not add_special_tokens or (not len(self._head) and not len(self._tail)):
            return content
        return np.concatenate((self._head, content, self._tail))

    def _truncated(self, content: np.ndarray, add: bool, keep: int | None, side: str | None) -> np.ndarray:
        if keep is None:
            return self._with_specials(content, add)
        if keep < 0:
            raise Unsupported("truncate_prompt_tokens -1 needs the model's length")
        if side is not None:
            if side not in ("left", "right"):
                raise TemplateError("`truncation_side` must be either 'left' or 'right'.")
            ids = self._with_specials(content, add)
            return ids if keep >= len(ids) else ids[len(ids) - keep :] if side == "left" else ids[:keep]
        room = keep - ((len(self._head) + len(self._tail)) if add else 0)
        if room < 0:
            raise Unsupported("truncate_prompt_tokens is smaller than the special tokens")
        if len(content) > room:
            content = content[len(content) - room :]
        return self._with_specials(content, add)

    def completion_ids(
        self,
        prompt: str,
        *,
        add_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
    ) -> np.ndarray:
        """A completions prompt's ids."""
        return self._completion_plan(prompt, add_special_tokens, truncate_prompt_tokens, truncation_side).finish()

    def _completion_plan(self, prompt: str, add: bool, keep: int | None, side: str | None) -> Plan:
        return self._request_plan(self._content_plan(prompt), add, keep, side)

    def _request_plan(self, content: Plan, add: bool, keep: int | None, side: str | None) -> Plan:
        """A request's plan from its content's: the special tokens around it, its truncation. A truncated
        prompt's start is not known before its whole length is."""
        known, estimated = None, 0
        if content.known is not None and keep is None:
            known = np.concatenate((self._head, content.known)) if add and len(self._head) else content.known
            estimated = content.estimated + ((len(self._head) + len(self._tail)) if add else 0)
        finish = content.finish
        return Plan(content.pending, lambda: self._truncated(finish(), add, keep, side), known, estimated,
                    content.head and known is not None)  # fmt: skip

    def chat_text(self, messages: Sequence[Any], options: ChatOptions | None = None) -> str:
        """The text the chat template renders (see :func:`epp.prefix.chat.render_chat`)."""
        return render_chat(self.chat, messages, options if options is not None else ChatOptions())

    def chat_ids(
        self,
        messages: Sequence[Any],
        options: ChatOptions | None = None,
        *,
        add_special_tokens: bool = False,
        truncate_prompt_tokens: int | None = None,
        truncation_side: str | None = None,
    ) -> np.ndarray:
        """A chat request's ids, from its messages as JSON values."""
        content = self._content_plan(self.chat_text(messages, options))
        return self._truncated(content.finish(), add_special_tokens, truncate_prompt_tokens, truncation_side)

    def request_ids(self, api: str, body: bytes) -> np.ndarray:
        """The engine's prompt ids for a ``completions`` or ``chat_completions`` request body."""
        return self.plan(api, body).finish()

    def plan(self, api: str, body: bytes) -> Plan:
        """:meth:`request_ids` but for the encoding, which :meth:`Plan.finish` does (the part worth a
        thread: HF tokenizers releases the GIL while it encodes); ``Plan.pending`` says how much text
        is left to encode. Raises as :meth:`request_ids` does."""
        try:
            if api == "completions":
                return self._completion_request(_DECODE_COMPLETION(body))
            if api == "chat_completions":
                return self._chat_request(_DECODE_CHAT(body))
        except msgspec.ValidationError as exc:
            raise Unsupported(f"a field takes a form this tokenizer does not read: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise Unsupported(f"body is not JSON msgspec reads: {exc}") from exc
        raise Unsupported(f"{api} requests have no prompt to tokenize here")

    def _completion_request(self, body: _CompletionBody) -> Plan:
        if body.prompt_embeds is not None:
            raise Unsupported("prompt_embeds")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
                return _done(self._given_ids(prompt, body))
            if isinstance(first, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in first):
                return _done(self._given_ids(first, body))
            if isinstance(first, str):
                prompt = first
        if not isinstance(prompt, str):
            raise Unsupported("prompt is not a string, a list of strings or token ids")
        return self._completion_plan(prompt, body.add_special_tokens, body.truncate_prompt_tokens, body.truncation_side)

    @staticmethod
    def _given_ids(ids: list[int], body: _CompletionBody) -> np.ndarray:
        if any(i < 0 or i >= 1 << 32 for i in ids):
            raise Unsupported("token ids out of range")
        array = np.array(ids, dtype=np.uint32)
        keep, side = body.truncate_prompt_tokens, body.truncation_side
        if keep is None or keep >= len(array):
            return array
        if keep < 0:
            raise Unsupported("truncate_prompt_tokens -1 needs the model's length")
        return array[:keep] if side == "right" else array[len(array) - keep :]

    def _chat_request(self, body: _ChatBody) -> Plan:
        reused = (body.kv_transfer_params or {}).get("prompt_token_ids")
        if reused is not None and not body.echo:
            if isinstance(reused, list) and reused and all(type(i) is int and 0 <= i < 1 << 32 for i in reused):
                self._text_only(body.messages)
                return _done(np.array(reused, dtype=np.uint32))
            raise TemplateError("`kv_transfer_params['prompt_token_ids']` must be a non-empty list of ids")
        options = ChatOptions(
            tools=body.tools,
            documents=body.documents,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            reasoning_effort=body.reasoning_effort,
        )
        content = self._content_plan(self.chat_text(body.messages, options))
        return self._request_plan(content, body.add_special_tokens, body.truncate_prompt_tokens, body.truncation_side)

    @staticmethod
    def _text_only(messages: list[Any]) -> None:
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") not in _TEXT_TYPES
                                                 for p in content):  # fmt: skip
                raise Unsupported("multimodal content")


class Plan:
    """A request's ids but for the encoding: ``pending`` characters (UTF-8 bytes) are left to encode,
    which :meth:`finish` does (at most once), returning the ids.

    A plan that reuses a cached prefix also says, before any encoding, what the ids start with:
    ``known``, the reused prefix's ids through its cut token (with what ``add_special_tokens`` puts
    before a text; None for a cold or truncated prompt), and ``estimated``, the prompt's whole length
    in tokens at the known part's bytes per token. ``finish`` returns ids that start with ``known``
    (the cut points are checked at load to split so; a text that does not is encoded whole, and
    counted in ``unstable``).

    ``head``: ``known`` is not a reused prefix but the ids of the text's first few hundred bytes,
    encoded on their own (a cold prompt, or one whose reused prefix is under a block: see "A cold
    prompt's head"). Those ids are the whole's start in all but odd texts (a word longer than the
    head); the caller checks once it has the whole."""

    __slots__ = ("_finish", "estimated", "head", "known", "pending")

    def __init__(
        self,
        pending: int,
        finish: Callable[[], np.ndarray],
        known: np.ndarray | None = None,
        estimated: int = 0,
        head: bool = False,
    ) -> None:
        self.pending = pending
        self._finish = finish
        self.known = known
        self.estimated = estimated
        self.head = head

    def finish(self) -> np.ndarray:
        return self._finish()


def _done(ids: np.ndarray) -> Plan:
    return Plan(0, lambda: ids)


_Digests = list[int] | None


def _digests(view: memoryview, ends: Sequence[int]) -> list[int]:
    """``xxh3_128(view[:end])`` for each of the ascending ``ends``, in one pass over the text."""
    hasher = xxhash.xxh3_128()
    out = []
    done = 0
    for end in ends:
        hasher.update(view[done:end])
        out.append(hasher.intdigest())
        done = end
    return out


def _rebuild_post_processor(tokenizer: Tokenizer, specials: Mapping[str, str], bos: bool, eos: bool) -> None:
    """transformers 5's update_post_processor: ``[BOS] $A [EOS]`` with the flags given."""
    bos_text, eos_text = specials.get("bos_token"), specials.get("eos_token")
    bos = bos and bos_text is not None and tokenizer.token_to_id(bos_text) is not None
    eos = eos and eos_text is not None and tokenizer.token_to_id(eos_text) is not None
    single = f"{str(bos_text) + ':0 ' if bos else ''}$A:0{' ' + str(eos_text) + ':0' if eos else ''}"
    pair = f"{single}{' ' + str(bos_text) + ':1' if bos else ''} $B:1{' ' + str(eos_text) + ':1' if eos else ''}"
    tokens = [(t, tokenizer.token_to_id(t)) for t, on in ((bos_text, bos), (eos_text, eos)) if on and t is not None]
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)
