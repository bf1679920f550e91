"""Read a few metrics from a model server's Prometheus ``/metrics`` page without tokenising it.

A pod's page is 30–60 KB (vLLM: a dozen histograms of ~25 buckets, counters, process metrics) and
it is scraped 20 times a second; a general parser spends milliseconds tokenising all of it. This
module never tokenises the page: for each wanted metric it locates that metric's sample lines with
``bytes.rfind`` (C speed, no allocation), then parses only those few lines; a 55 KB vLLM page costs
a few tens of µs, ~200 times less than ``prometheus_client``'s parser (``bench/parse_metrics.py``).
What is wanted, and which field a value fills, is the engine table's business
(:mod:`epp.datalayer.engines`); here a wanted metric is a :class:`CompiledSelector`.

Rules of reading (nothing here raises on the page's content):

* a series whose value is NaN, infinite or negative, or whose line is malformed, is ignored;
  :meth:`Page.total` sums the usable series of the first selector that has any, :meth:`Page.largest`
  takes their maximum, and a selector list with nothing usable is reported missing;
* of an info-style metric (``cache_config_info``) the first matching series is read
  (:meth:`Page.cache_info`);
* ``vllm:lora_requests_info`` keeps one series per label combination ever seen, whose value is the
  time it was last current: the series with the **highest value** wins (:meth:`Page.lora`). vLLM
  only serves it with LoRA enabled, so its absence is not an error (upstream agrees).

The search. It relies on the exposition format's grouping rule (all samples of one metric form one
block of lines after its HELP/TYPE header, comments allowed in between): it finds one sample line of
the metric, then takes the block around it. Samples must start at the beginning of a line.

Small pages. A scraper that asks for only the metrics it reads (``?name[]=...``) gets ~2 KB, where
the per-metric searches cost more than the page is worth. Pages up to ``_INDEX_MAX_BYTES`` are read
with one ``findall`` of a regex made of the wanted metric names (:func:`sample_runs`), which returns
each metric's run of adjacent sample lines; a page where a metric's lines are not one run (the
grouping rule broken) falls back to the search, so that both ways always give the same answer (a
test compares them on mutated pages). Two readings that change seldom are remembered by their bytes
(a bounded LRU): a ``cache_config_info`` line, and the labels of the newest LoRA series. Together
these make a filtered vLLM page (bench/scrape_cost.py's, ~2 KB) ~2x cheaper to read: ~33 -> ~17 µs
of CPU each.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter, methodcaller
from typing import TypeAlias

from epp.datalayer.selectors import Selector, escape_label_value

__all__ = ["CacheInfoLabels", "CompiledSelector", "Page", "read_page", "sample_runs"]

# Label pairs, for the rare label block with escapes or blanks around '=' (the fast path is _label).
# The quoted value is an unrolled loop ([^"\\]* (\\. [^"\\]*)*) so that sre never backtracks per character.
_PAIR_SRC = rb'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\\n]*(?:\\[^\n][^"\\\n]*)*)"'
_PAIR = re.compile(_PAIR_SRC)
_BLOCK = re.compile(rb"[ \t]*(?:" + _PAIR_SRC + rb"[ \t]*(?:,[ \t]*" + _PAIR_SRC + rb"[ \t]*)*(?:,[ \t]*)?)?")
_ESCAPE = re.compile(rb"\\(.)")
_HEADER = (b"# HELP ", b"# TYPE ")  # a metric's block starts after these
_SKIPPED = (b"#", b"\n", b"\r")  # other comments and blank lines may sit inside a block
_LABEL_START = b"{, \t"  # what may precede a label name in a block
_THIRD = itemgetter(2)
_NAME_PART = methodcaller("strip", b" \t,=")  # ',name=' -> 'name'

# Lines walked back from a hit before the block is delimited by its HELP/TYPE header instead (one rfind,
# however long the block: vLLM's lora_requests_info grows by a series per adapter combination ever seen).
_WALK_LINES = 1

# Neighbouring metrics are usually registered, hence served, together (vLLM's running/waiting/KV
# gauges sit within ~1 KB of each other): each search first looks this far around the previous hit,
# a twentieth of a whole-page search.
_NEAR_BYTES = 2048

# Pages up to this size are indexed in one pass (:func:`_index`) rather than searched metric by metric.
# A ?name[]= filtered vLLM page is ~2 KB. Measured on the ends of a 52 KB vLLM page, the index reads
# 4 KB in 14 µs (search: 23), 16 KB in 20 (28), 32 KB in 30 (36), the whole page in 45 (35).
_INDEX_MAX_BYTES = 16 * 1024

_NO_ADAPTERS: frozenset[str] = frozenset()

CacheInfoLabels: TypeAlias = tuple[tuple[bytes, bytes], tuple[bytes, bytes], tuple[bytes, bytes]]
"""The block-size, number-of-blocks and cache-size-in-tokens label names of an info metric, each as
``(name, name + b'="')``. The third is optional: vLLM's ``kv_cache_size_tokens`` (its profiled capacity,
which hybrid and sliding-window models do not have as blocks x block size), never reported missing."""


class CompiledSelector:
    """A selector in the form the page search wants: byte needles and escaped label values."""

    __slots__ = ("matchers", "name", "needle", "prefixes", "text")

    def __init__(self, selector: Selector) -> None:
        name = selector.name.encode()
        self.text = str(selector)
        self.name = name
        self.needle = b"\n" + name
        self.prefixes = (name + b"{", name + b" ", name + b"\t")
        # Compared with the raw (still escaped) bytes of the page: the format has one escaping per value.
        self.matchers = tuple(
            (k.encode(), k.encode() + b'="', escape_label_value(v).encode() if v else None) for k, v in selector.labels
        )


def sample_runs(names: Iterable[str]) -> re.Pattern[bytes] | None:
    """The one-pass index's regex for these metric names (None for no names): see :func:`read_page`."""
    # A run of adjacent sample lines of one of the metrics read: "\n", the name (longest alternatives
    # first, so that a prefix never wins), the rest of the line, which must start with '{', ' ' or
    # '\t', then as many following lines of the same name (\1) as there are.
    escaped = sorted((re.escape(name.encode()) for name in names), key=len, reverse=True)
    if not escaped:
        return None
    rest = rb"[{ \t][^\n]*"
    return re.compile(rb"\n(" + b"|".join(escaped) + rb")(" + rest + rb"(?:\n\1" + rest + rb")*)")


def read_page(page: bytes, runs: re.Pattern[bytes] | None) -> Page:
    """``page`` ready to be read: indexed in one pass by ``runs`` (:func:`sample_runs`) if it is small
    and keeps the grouping rule, else searched metric by metric."""
    index = None
    if len(page) <= _INDEX_MAX_BYTES and runs is not None:
        index = _index(runs, page)
    return Page(page, index)


def _index(runs: re.Pattern[bytes], page: bytes) -> dict[bytes, bytes] | None:
    """A small page's sample lines by metric name, as one run of lines per metric (see
    :meth:`Page._lines`); None if a metric's lines are not all adjacent, as the exposition format's
    grouping rule wants them.

    One ``findall`` reads them all, several times faster than searching for each metric on a 2 KB
    page (on a 50 KB page the search is faster). For a page that keeps the grouping rule both give
    the same lines (``tests/datalayer/test_page.py`` compares them on mutated pages); a page that
    breaks it is left to the search, whose answer is the reference.
    """
    found = runs.findall(b"\n" + page)
    index = dict(found)
    return index if len(index) == len(found) else None  # a name twice: two runs of its lines


class Page:
    """One page being searched; remembers where the last metric was found, to look near it first.

    With an ``index`` (see :func:`_index`) the lines come from it instead, without the metric name
    (:meth:`_skip` tells :func:`_sample` how many bytes of name to pass over: 0, or the name's length).
    """

    __slots__ = ("index", "near", "page")

    def __init__(self, page: bytes, index: dict[bytes, bytes] | None = None) -> None:
        self.page = page
        self.near = -1
        self.index = index

    def _skip(self, src: CompiledSelector) -> int:
        return len(src.name) if self.index is None else 0

    def _lines(self, src: CompiledSelector) -> list[bytes]:
        """The sample lines of ``src``'s metric (without line ends), in page order; empty if absent."""
        if self.index is not None:
            run = self.index.get(src.name)
            return [] if run is None else run.split(src.needle)  # the lines after the first start with needle
        page = self.page
        prefixes = src.prefixes
        near = self.near
        hit = -1
        if near >= 0:
            hit = self._last_in(src, near - _NEAR_BYTES if near > _NEAR_BYTES else 0, near + _NEAR_BYTES)
        cut = hit >= 0  # found in a window, which may have cut the block short
        if not cut:
            hit = self._last_in(src, 0, len(page))
            if hit < 0:
                return []
        self.near = hit
        start, steps = hit, 0
        while start > 0:  # back to the block's first line: one step for one series, the header for more
            prev = page.rfind(b"\n", 0, start - 1) + 1
            if not (page.startswith(prefixes, prev) or _inside(page, prev)):
                break
            start = prev
            steps += 1
            if steps == _WALK_LINES:
                header = max(page.rfind(b"\n# HELP ", 0, start), page.rfind(b"\n# TYPE ", 0, start))
                if header >= 0:
                    start = header + 1  # the header line itself is filtered out below
                    break
        end = page.find(b"\n", hit)
        single = start == hit
        if cut and end >= 0 and (page.startswith(prefixes, end + 1) or _inside(page, end + 1)):
            # The block goes on past the window: it ends where the next family's header starts.
            ends = [i for i in (page.find(b"\n# HELP ", end), page.find(b"\n# TYPE ", end)) if i >= 0]
            end = min(ends) if ends else -1
            single = False
        if end < 0:
            end = len(page)
        if single:  # the usual case, one series
            return [page[hit:end]]
        # Comments, blank lines and (on pages without headers) other metrics' lines drop out here.
        return list(filter(methodcaller("startswith", prefixes), page[start:end].split(b"\n")))

    def _samples(self, src: CompiledSelector) -> list[tuple[float, bytes]]:
        """(value, raw label block) of every well-formed sample of ``src`` whose labels match, in page order."""
        return _samples(self._lines(src), self._skip(src), src.matchers)

    def _last_in(self, src: CompiledSelector, lo: int, hi: int) -> int:
        """Start of the last sample line of the metric that lies in page[lo:hi], or -1."""
        page, needle, prefixes = self.page, src.needle, src.prefixes
        end = hi
        while True:
            # rfind: its search anchors on the needle's first byte, the rare b"\n", and runs twice as fast
            # as find's two-way search on these pages (and the metrics we want tend to be near the end).
            i = page.rfind(needle, lo, end)
            if i < 0:
                return 0 if lo == 0 and page.startswith(prefixes) else -1
            if page.startswith(prefixes, i + 1):
                return i + 1
            end = i + len(needle) - 1  # a longer name (``foo_total`` for ``foo``): look before it

    def _values(self, sources: tuple[CompiledSelector, ...], missing: list[str]) -> list[float] | None:
        for src in sources:
            values = [v for v, _ in self._samples(src) if v >= 0.0 and v != math.inf]  # NaN fails v >= 0
            if values:
                return values
        missing.extend(src.text for src in sources)
        return None

    def total(self, sources: tuple[CompiledSelector, ...], missing: list[str]) -> int | None:
        """Sum over the matching series of the first selector that has any: a count."""
        if not sources:
            return None
        values = self._values(sources, missing)
        return None if values is None else round(math.fsum(values))

    def largest(self, sources: tuple[CompiledSelector, ...], missing: list[str]) -> float | None:
        """Maximum over the matching series of the first selector that has any."""
        if not sources:
            return None
        values = self._values(sources, missing)
        return None if values is None else max(values)

    def lora(self, src: CompiledSelector, missing: list[str]) -> tuple[frozenset[str], frozenset[str], int | None]:
        block = self._newest(src)
        if block is None:  # no LoRA on this server: not an error
            return _NO_ADAPTERS, _NO_ADAPTERS, None
        running, waiting, max_lora = _lora_labels(block)
        if max_lora is None:
            missing.append(f"{src.text} label max_lora")
        return running, waiting, max_lora

    def _newest(self, src: CompiledSelector) -> bytes | None:
        """The label block of the series with the highest value (vLLM keeps every combination ever seen)."""
        lines = self._lines(src)
        if not lines:
            return None
        if not src.matchers:
            # Fast paths, C loops only: the text after each line's last '}' is its value. Anything unusual
            # (no labels, a timestamp, NaN, a malformed winner) takes the exact path below.
            tails = list(map(bytes.strip, map(_THIRD, map(bytes.rpartition, lines, repeat(b"}")))))
            winner = -1
            dots = set(map(bytes.find, tails, repeat(b".")))
            if (len(dots) == 1 and (-1 not in dots or len(set(map(len, tails))) == 1)
                    and not b"".join(tails).translate(None, b"0123456789.")):
                # Plain decimals with the decimal point at the same place (vLLM's time.time() values):
                # they compare as strings, which spares float()'s ~0.3 µs on 17-digit numbers.
                winner = tails.index(max(tails))
            else:
                try:
                    values = list(map(float, tails))
                except ValueError:
                    values = []
                if values and (best := max(values)) == best:  # not NaN: max() with NaN depends on order
                    winner = values.index(best)
            if winner >= 0:
                sample = _sample(lines[winner], self._skip(src))
                if sample is not None:
                    return sample[1]
        winner_block, best_value = None, -math.inf
        for value, block in self._samples(src):
            if value > best_value:  # NaN never wins; on ties the first series does
                winner_block, best_value = block, value
        return winner_block

    def cache_info(
        self, src: CompiledSelector, labels: CacheInfoLabels, missing: list[str]
    ) -> tuple[int | None, int | None, int | None]:
        """Block size, number of blocks and cache size in tokens from the first matching series."""
        if self.index is None:
            block_size, num_blocks, size_tokens, lacking = _cache_info(self._samples(src), src, labels)
        else:
            run = self.index.get(src.name)
            if run is None:
                missing.append(src.text)
                return None, None, None
            block_size, num_blocks, size_tokens, lacking = _cache_info_of_run(run, src, labels)
        missing.extend(lacking)
        return block_size, num_blocks, size_tokens


# What a pod's cache_config_info line and the labels of its newest LoRA series say change seldom
# (never, and when the set of adapters in use changes): their readings are remembered, keyed by
# the raw bytes. The numbers that change every scrape (queue, running, KV usage) are always read.
_REMEMBERED = 256


def _cache_info(
    samples: list[tuple[float, bytes]], src: CompiledSelector, labels: CacheInfoLabels
) -> tuple[int | None, int | None, int | None, tuple[str, ...]]:
    """Block size, number of blocks, cache size in tokens and what is missing (of the first two), from
    the first matching series' labels."""
    if not samples:
        return None, None, None, (src.text,)
    block = samples[0][1]
    found = [_int(_label(block, name, key)) for name, key in labels]
    lacking = tuple(f"{src.text} label {name.decode()}" for (name, _), value in zip(labels[:2], found, strict=False)
                    if value is None)
    return found[0], found[1], found[2], lacking


@functools.lru_cache(maxsize=_REMEMBERED)
def _cache_info_of_run(
    run: bytes, src: CompiledSelector, labels: CacheInfoLabels
) -> tuple[int | None, int | None, int | None, tuple[str, ...]]:
    return _cache_info(_samples(run.split(src.needle), 0, src.matchers), src, labels)


@functools.lru_cache(maxsize=_REMEMBERED)
def _lora_labels(block: bytes) -> tuple[frozenset[str], frozenset[str], int | None]:
    """Running adapters, waiting adapters and max_lora from a lora_requests_info label block."""
    labels = _labels(block)
    return (
        _adapters(labels.get(b"running_lora_adapters")),
        _adapters(labels.get(b"waiting_lora_adapters")),
        _int(labels.get(b"max_lora")),
    )


def _samples(
    lines: list[bytes], skip: int, matchers: tuple[tuple[bytes, bytes, bytes | None], ...]
) -> list[tuple[float, bytes]]:
    """(value, raw label block) of every well-formed sample line whose labels match, in order."""
    out = []
    for line in lines:
        sample = _sample(line, skip)
        if sample is not None and (not matchers or _matches(sample[1], matchers)):
            out.append(sample)
    return out


def _sample(line: bytes, skip: int) -> tuple[float, bytes] | None:
    """(value, raw label block) of a sample line whose metric name is ``skip`` bytes long, None if malformed."""
    rest = line[skip:]
    block = b""
    if not rest.startswith(b"{"):
        rest = rest.lstrip(b" \t")
    if rest.startswith(b"{"):
        close = rest.rfind(b"}")  # values and timestamps have no '}': the last one closes the block
        if close < 0:
            return None
        block = rest[1:close]
        if b"\\" in block:  # escapes: only a full match tells a closing quote from an escaped one
            if _BLOCK.fullmatch(block) is None:
                return None
        elif block.count(b'"') & 1:  # an unterminated value
            return None
        rest = rest[close + 1 :]
    fields = rest.split()  # the value and an optional timestamp (ignored)
    if not fields or len(fields) > 2 or b"_" in fields[0]:  # float() takes 1_000, the format does not
        return None
    try:
        return float(fields[0]), block
    except ValueError:
        return None


def _inside(page: bytes, pos: int) -> bool:
    """Whether the line at ``pos`` may sit inside a metric's block: a comment other than HELP/TYPE, or blank."""
    return page.startswith(_SKIPPED, pos) and not page.startswith(_HEADER, pos)


def _matches(block: bytes, matchers: tuple[tuple[bytes, bytes, bytes | None], ...]) -> bool:
    # A label the series lacks reads as "" (PromQL's rule), so name="" matches its absence.
    return all((_label(block, name, key) or None) == want for name, key, want in matchers)


def _label(block: bytes, name: bytes, key: bytes) -> bytes | None:
    """The raw (escaped) value of label ``name`` in a label block; ``key`` is ``name + b'="'``."""
    if b"\\" not in block:
        # Fast path: without escapes, a '"' is always a delimiter, so ``name="`` preceded by an even
        # number of quotes and by a separator is the label itself, not text inside another value.
        k = block.find(key)
        while k >= 0:
            if (k == 0 or block[k - 1] in _LABEL_START) and not block.count(b'"', 0, k) & 1:
                j = k + len(key)
                e = block.find(b'"', j)
                return block[j:e] if e >= 0 else None
            k = block.find(key, k + 1)
        if b" =" not in block and b"= " not in block and b"\t" not in block:
            return None
    for label, value in _PAIR.findall(block):  # escapes or spaced '=': the exact, slower way
        if label == name:
            return value
    return None


def _labels(block: bytes) -> dict[bytes, bytes]:
    """All labels of a well-formed block (see _sample), values still escaped."""
    if b"\\" in block:
        return dict(_PAIR.findall(block))
    # Without escapes every '"' is a delimiter: names (with their ',' and '=') and values alternate,
    # and the text after the last value (empty, or a trailing ',') is a name with no value.
    parts = block.split(b'"')
    return dict(zip(map(_NAME_PART, parts[0::2]), parts[1::2], strict=False))


def _int(raw: bytes | None) -> int | None:
    return int(raw) if raw is not None and raw.isdigit() and len(raw) < 20 else None


def _unescape(raw: bytes) -> str:
    if b"\\" in raw:
        raw = _ESCAPE.sub(lambda m: b"\n" if m.group(1) == b"n" else m.group(1), raw)
    return raw.decode("utf-8", "replace")


def _adapters(raw: bytes | None) -> frozenset[str]:
    if not raw:
        return _NO_ADAPTERS
    return frozenset(name for part in _unescape(raw).split(",") if (name := part.strip()))
