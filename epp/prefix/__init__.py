"""The prefix-cache indexes: prompt hashing and per-pod indexes of the prompt blocks each pod holds.

A leaf library (it imports nothing else of epp; numpy, xxhash, msgspec, pyzmq, tokenizers, jinja2,
aiohttp and the standard library): the prefix-cache producer plugins build on it. The approximate
index (what this picker sent where) is designed in :mod:`epp.prefix.index`, which says where each
part lives; the precise one, fed by the model servers' own KV-cache events, in
:mod:`epp.prefix.kvindex` (blocks), :mod:`epp.prefix.kvwire` (the events' wire format) and
:mod:`epp.prefix.kvsubscriber` (zmq). A request's token ids, as the engine computes them, come from
:mod:`epp.prefix.tokenize` (the model's tokenizer files; :mod:`epp.prefix.chat` renders its chat
template) or :mod:`epp.prefix.remote` (the engine's ``/tokenize``).
"""

from epp.prefix.hashing import CHARS_PER_TOKEN, DEFAULT_BLOCK_SIZE_TOKENS, DEFAULT_MAX_PREFIX_TOKENS, prompt_hashes
from epp.prefix.index import DEFAULT_LRU_CAPACITY_PER_SERVER, PrefixIndex, PrefixIndexStats, PrefixLookup

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_BLOCK_SIZE_TOKENS",
    "DEFAULT_LRU_CAPACITY_PER_SERVER",
    "DEFAULT_MAX_PREFIX_TOKENS",
    "PrefixIndex",
    "PrefixIndexStats",
    "PrefixLookup",
    "prompt_hashes",
]
