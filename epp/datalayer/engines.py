"""Read the handful of values the picker needs from a model server's Prometheus ``/metrics`` page.

A pod's page is 30–60 KB (vLLM: a dozen histograms of ~25 buckets, counters, process metrics) and
it is scraped 20 times a second; a general parser spends milliseconds tokenising all of it. This
module never tokenises the page: for each wanted metric it locates that metric's sample lines with
``bytes.rfind`` (C speed, no allocation), then parses only those few lines; a 55 KB vLLM page costs
a few tens of µs, ~200 times less than ``prometheus_client``'s parser (``bench/parse_metrics.py``).

What is wanted is an :class:`EngineMapping`: per engine, one *metric selector* per field, in the
syntax of upstream's ``core-metrics-extractor`` ``engineConfigs`` (a PromQL instant-vector selector
restricted to equality matchers: ``name`` or ``name{label="value",other=value}``). Built-in
mappings exist for vLLM, SGLang, trtllm-serve and Triton's TensorRT-LLM backend
(:func:`builtin_engines`), selected per pod by the ``inference.networking.k8s.io/engine-type``
label (:func:`engine_for_label`); :func:`engine_from_config` builds one from upstream's config keys.

Rules of extraction (the parser never raises on the page's content):

* a selector matching several series (per ``model_name``, per data-parallel ``engine``): queue and
  running counts are **summed** (the pod's total work), KV-cache usage and the cache-geometry gauges
  take the **maximum** (the most loaded engine is the one that preempts first); info-style metrics
  (``cache_config_info``) take the first matching series;
* ``vllm:lora_requests_info`` keeps one series per label combination ever seen, whose value is the
  time it was last current: the series with the **highest value** wins. vLLM only serves it with
  LoRA enabled, so its absence is not an error (upstream agrees);
* a series whose value is NaN, infinite or negative, or whose line is malformed, is ignored;
* a field whose selectors match nothing usable is ``None`` and its selectors are listed in
  :attr:`EngineMetrics.missing`; a field with no selector (disabled) is ``None`` and not listed.

The search relies on the exposition format's grouping rule (all samples of one metric form one
block of lines after its HELP/TYPE header, comments allowed in between): it finds one sample line of
the metric, then takes the block around it. Samples must start at the beginning of a line.

Small pages. A scraper that asks for only the metrics it reads (``?name[]=...``) gets ~2 KB, where
the per-metric searches cost more than the page is worth. Pages up to ``_INDEX_MAX_BYTES`` are read
with one ``findall`` of a regex made of the mapping's metric names, which returns each metric's run
of adjacent sample lines; a page where a metric's lines are not one run (the grouping rule broken)
falls back to the search, so that both ways always give the same answer (a test compares them on
mutated pages). Two readings that change seldom are remembered by their bytes (a bounded LRU): a
``cache_config_info`` line, and the labels of the newest LoRA series. Together these make a
filtered vLLM page (bench/scrape_cost.py's, ~2 KB) ~2x cheaper to read: ~33 -> ~17 µs of CPU each.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import itemgetter, methodcaller

__all__ = [
    "ENGINE_TYPE_LABEL",
    "LLMD_ENGINE_TYPE_LABEL",
    "EngineMapping",
    "EngineMetrics",
    "Selector",
    "builtin_engines",
    "engine_for_label",
    "engine_from_config",
    "parse_selector",
]

ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
"""The pod label that names the engine (upstream GIE's default ``engineLabelKey``)."""
LLMD_ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
"""The same label under llm-d-router's name (which still falls back to :data:`ENGINE_TYPE_LABEL`)."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

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


# --------------------------------------------------------------------------------------------- selectors


@dataclass(frozen=True, slots=True, repr=False)
class Selector:
    """A metric name and the label values a series must have (equality matchers only)."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ValueError(f"invalid metric name {self.name!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")
        for label, _ in self.labels:
            if not _LABEL_NAME.match(label):
                raise ValueError(f"invalid label name {label!r} in selector for {self.name!r}")

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in self.labels)
        return f"{self.name}{{{pairs}}}"

    def __repr__(self) -> str:
        return f"Selector({str(self)!r})"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_selector(text: str) -> Selector:
    """Parse ``name`` or ``name{label="value",...}`` (values may also be unquoted, as upstream allows).

    Raises :class:`ValueError` saying what is wrong. An empty string is an error here; configuration
    uses it to disable a field (see :func:`engine_from_config`).
    """
    s = text.strip()
    if not s:
        raise ValueError("empty metric selector")
    brace = s.find("{")
    name = (s if brace < 0 else s[:brace]).strip()
    if not _METRIC_NAME.match(name):
        raise ValueError(f"invalid metric name {name!r} in selector {text!r}: must match [a-zA-Z_:][a-zA-Z0-9_:]*")
    if brace < 0:
        return Selector(name)
    labels: dict[str, str] = {}
    i, n = brace + 1, len(s)
    while True:
        while i < n and s[i] in " \t":
            i += 1
        if i < n and s[i] == "}":
            break
        j = i
        while j < n and (s[j].isalnum() or s[j] == "_"):
            j += 1
        label = s[i:j]
        while j < n and s[j] in " \t":
            j += 1
        if j >= n:
            raise ValueError(f"unclosed '{{' in selector {text!r}")
        if s.startswith(("!=", "=~", "!~"), j):
            raise ValueError(f"only equality matchers (label=\"value\") are supported, got {s[j:j + 2]!r} in {text!r}")
        if not label or s[j] != "=":
            raise ValueError(f"expected label=\"value\" at {s[i:i + 20]!r} in selector {text!r}")
        if not _LABEL_NAME.match(label):
            raise ValueError(f"invalid label name {label!r} in selector {text!r}")
        j += 1
        while j < n and s[j] in " \t":
            j += 1
        value, i = _selector_value(s, j, text)
        if label in labels:
            raise ValueError(f"label {label!r} given twice in selector {text!r}")
        labels[label] = value
        while i < n and s[i] in " \t":
            i += 1
        if i >= n:
            raise ValueError(f"unclosed '{{' in selector {text!r}")
        if s[i] == ",":
            i += 1
        elif s[i] != "}":
            raise ValueError(f"expected ',' or '}}' after label {label!r} in selector {text!r}")
    if s[i + 1 :].strip():
        raise ValueError(f"unexpected text {s[i + 1:]!r} after '}}' in selector {text!r}")
    return Selector(name, tuple(labels.items()))


def _selector_value(s: str, i: int, text: str) -> tuple[str, int]:
    """One label value starting at ``s[i]``: quoted (with \\\\, \\" and \\n escapes) or bare."""
    n = len(s)
    if i < n and s[i] == '"':
        out: list[str] = []
        i += 1
        while i < n:
            c = s[i]
            if c == '"':
                return "".join(out), i + 1
            if c == "\\":
                if i + 1 >= n or s[i + 1] not in '\\"n':
                    raise ValueError(f"invalid escape {s[i:i + 2]!r} in selector {text!r} (only \\\\, \\\" and \\n)")
                out.append("\n" if s[i + 1] == "n" else s[i + 1])
                i += 2
            else:
                out.append(c)
                i += 1
        raise ValueError(f"unterminated quoted label value in selector {text!r}")
    j = i
    while j < n and not s[j].isspace() and s[j] not in '",{}=!~':
        j += 1
    if j == i:
        raise ValueError(f"missing label value at {s[i:i + 20]!r} in selector {text!r}")
    return s[i:j], j


class _Compiled:
    """A selector in the form the page search wants: byte needles and escaped label values."""

    __slots__ = ("text", "name", "needle", "prefixes", "matchers")

    def __init__(self, selector: Selector) -> None:
        name = selector.name.encode()
        self.text = str(selector)
        self.name = name
        self.needle = b"\n" + name
        self.prefixes = (name + b"{", name + b" ", name + b"\t")
        # Compared with the raw (still escaped) bytes of the page: the format has one escaping per value.
        self.matchers = tuple(
            (k.encode(), k.encode() + b'="', _escape(v).encode() if v else None) for k, v in selector.labels
        )


# --------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What one scrape of one pod says, in the engine-neutral terms the scheduler uses."""

    waiting_queue_size: int | None
    """Requests queued in the engine."""
    running_requests: int | None
    """Requests in the running batch."""
    kv_cache_usage: float | None
    """Fraction of the KV cache in use, 0..1."""
    running_adapters: frozenset[str]
    """LoRA adapters in the running batch."""
    waiting_adapters: frozenset[str]
    """LoRA adapters of queued requests."""
    max_adapters: int | None
    """Adapters the engine can hold at once (vLLM's ``max_lora``)."""
    block_size: int | None
    """Tokens per KV-cache block."""
    num_gpu_blocks: int | None
    """KV-cache blocks on the GPU."""
    missing: tuple[str, ...]
    """Selectors (or ``selector label name``) configured but not found usable on the page: an error state."""


_NO_ADAPTERS: frozenset[str] = frozenset()


# --------------------------------------------------------------------------------------------- mappings


@dataclass(frozen=True, slots=True)
class EngineMapping:
    """Which metrics of one engine's page fill which :class:`EngineMetrics` field.

    Count, usage and gauge fields take a tuple of alternatives: the first selector with a usable
    sample wins (vLLM's ``kv_cache_usage_perc`` replaced ``gpu_cache_usage_perc``). An empty tuple
    or ``None`` disables the field. Immutable; :meth:`parse` may be called from anywhere.
    """

    name: str
    """The engine, as the engine-type pod label names it: ``vllm``, ``sglang``, ``trtllm-serve``, ..."""
    queued_requests: tuple[Selector, ...] = ()
    running_requests: tuple[Selector, ...] = ()
    kv_usage: tuple[Selector, ...] = ()
    lora: Selector | None = None
    cache_info: Selector | None = None
    """An info-style metric whose labels carry the block size and the number of blocks."""
    cache_block_size_label: str = "block_size"
    cache_num_blocks_label: str = "num_gpu_blocks"
    cache_block_size: tuple[Selector, ...] = ()
    """Block size as a gauge value, used when ``cache_info`` gives none."""
    cache_num_blocks: tuple[Selector, ...] = ()
    """Number of GPU blocks as a gauge value, used when ``cache_info`` gives none."""
    _plan: tuple[object, ...] = field(init=False, repr=False, compare=False)
    _sample_runs: re.Pattern[bytes] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def many(sels: tuple[Selector, ...]) -> tuple[_Compiled, ...]:
            if not isinstance(sels, tuple) or not all(isinstance(s, Selector) for s in sels):
                raise TypeError(f"engine {self.name!r}: expected a tuple of Selector, got {sels!r}")
            return tuple(_Compiled(s) for s in sels)

        def one(sel: Selector | None) -> _Compiled | None:
            if sel is not None and not isinstance(sel, Selector):
                raise TypeError(f"engine {self.name!r}: expected a Selector or None, got {sel!r}")
            return None if sel is None else _Compiled(sel)

        plan = (
            many(self.queued_requests), many(self.running_requests), many(self.kv_usage), one(self.lora),
            one(self.cache_info),
            tuple((n.encode(), n.encode() + b'="') for n in (self.cache_block_size_label, self.cache_num_blocks_label)),
            many(self.cache_block_size), many(self.cache_num_blocks),
        )
        object.__setattr__(self, "_plan", plan)
        # A run of adjacent sample lines of one of the metrics read: "\n", the name (longest alternatives
        # first, so that a prefix never wins), the rest of the line, which must start with '{', ' ' or
        # '\t', then as many following lines of the same name (\1) as there are.
        names = sorted((re.escape(name.encode()) for name in self.metric_names()), key=len, reverse=True)
        rest = rb"[{ \t][^\n]*"
        runs = re.compile(rb"\n(" + b"|".join(names) + rb")(" + rest + rb"(?:\n\1" + rest + rb")*)") if names else None
        object.__setattr__(self, "_sample_runs", runs)

    def metric_names(self) -> tuple[str, ...]:
        """Every metric name this mapping may read, in a stable order, without duplicates.

        A scraper can ask a prometheus_client-based server (vLLM, SGLang) for just these
        (``?name[]=...``) instead of the whole page.
        """
        selectors = [
            *self.queued_requests, *self.running_requests, *self.kv_usage,
            *(s for s in (self.lora, self.cache_info) if s is not None),
            *self.cache_block_size, *self.cache_num_blocks,
        ]  # fmt: skip
        return tuple(dict.fromkeys(selector.name for selector in selectors))

    def parse(self, page: bytes) -> EngineMetrics:
        """Extract this engine's values from one ``/metrics`` page (any bytes-like object).

        Never raises on the page's content: an HTML error page, a truncated body or random bytes give
        ``None`` fields, each listed in :attr:`EngineMetrics.missing`.
        """
        if not isinstance(page, bytes):
            page = bytes(page)
        index = None
        if len(page) <= _INDEX_MAX_BYTES and self._sample_runs is not None:
            index = _index(self._sample_runs, page)
        return self._extract(_Scan(page, index))

    def _extract(self, scan: _Scan) -> EngineMetrics:
        queued, running, kv, lora, info, info_labels, bs_gauges, nb_gauges = self._plan  # type: ignore[misc]
        missing: list[str] = []
        waiting_n = scan.total(queued, missing)
        running_n = scan.total(running, missing)
        usage = scan.largest(kv, missing)
        running_a = waiting_a = _NO_ADAPTERS
        max_a = None
        if lora is not None:
            running_a, waiting_a, max_a = scan.lora(lora, missing)
        block_size = num_blocks = None
        info_missing: list[str] = []
        if info is not None:
            block_size, num_blocks = scan.cache_info(info, info_labels, info_missing)
        if block_size is None and bs_gauges:
            value = scan.largest(bs_gauges, info_missing)
            block_size = None if value is None else round(value)
        if num_blocks is None and nb_gauges:
            value = scan.largest(nb_gauges, info_missing)
            num_blocks = None if value is None else round(value)
        if block_size is None or num_blocks is None:
            missing.extend(dict.fromkeys(info_missing))
        return EngineMetrics(
            waiting_queue_size=waiting_n,
            running_requests=running_n,
            kv_cache_usage=usage,
            running_adapters=running_a,
            waiting_adapters=waiting_a,
            max_adapters=max_a,
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            missing=tuple(missing),
        )


def _index(runs: re.Pattern[bytes], page: bytes) -> dict[bytes, bytes] | None:
    """A small page's sample lines by metric name, as one run of lines per metric (see
    :meth:`_Scan._lines`); None if a metric's lines are not all adjacent, as the exposition format's
    grouping rule wants them.

    One ``findall`` reads them all, several times faster than searching for each metric on a 2 KB
    page (on a 50 KB page the search is faster). For a page that keeps the grouping rule both give
    the same lines (``tests/test_engine_metrics.py`` compares them on mutated pages); a page that
    breaks it is left to the search, whose answer is the reference.
    """
    found = runs.findall(b"\n" + page)
    index = dict(found)
    return index if len(index) == len(found) else None  # a name twice: two runs of its lines


class _Scan:
    """One page being searched; remembers where the last metric was found, to look near it first.

    With an ``index`` (see :func:`_index`) the lines come from it instead, without the metric name
    (:meth:`_skip` tells :func:`_sample` how many bytes of name to pass over: 0, or the name's length).
    """

    __slots__ = ("page", "near", "index")

    def __init__(self, page: bytes, index: dict[bytes, bytes] | None = None) -> None:
        self.page = page
        self.near = -1
        self.index = index

    def _skip(self, src: _Compiled) -> int:
        return len(src.name) if self.index is None else 0

    def _lines(self, src: _Compiled) -> list[bytes]:
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

    def _samples(self, src: _Compiled) -> list[tuple[float, bytes]]:
        """(value, raw label block) of every well-formed sample of ``src`` whose labels match, in page order."""
        return _samples(self._lines(src), self._skip(src), src.matchers)

    def _last_in(self, src: _Compiled, lo: int, hi: int) -> int:
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

    def _values(self, sources: tuple[_Compiled, ...], missing: list[str]) -> list[float] | None:
        for src in sources:
            values = [v for v, _ in self._samples(src) if v >= 0.0 and v != math.inf]  # NaN fails v >= 0
            if values:
                return values
        missing.extend(src.text for src in sources)
        return None

    def total(self, sources: tuple[_Compiled, ...], missing: list[str]) -> int | None:
        """Sum over the matching series of the first selector that has any: a count."""
        if not sources:
            return None
        values = self._values(sources, missing)
        return None if values is None else round(math.fsum(values))

    def largest(self, sources: tuple[_Compiled, ...], missing: list[str]) -> float | None:
        """Maximum over the matching series of the first selector that has any."""
        if not sources:
            return None
        values = self._values(sources, missing)
        return None if values is None else max(values)

    def lora(self, src: _Compiled, missing: list[str]) -> tuple[frozenset[str], frozenset[str], int | None]:
        block = self._newest(src)
        if block is None:  # no LoRA on this server: not an error
            return _NO_ADAPTERS, _NO_ADAPTERS, None
        running, waiting, max_lora = _lora_labels(block)
        if max_lora is None:
            missing.append(f"{src.text} label max_lora")
        return running, waiting, max_lora

    def _newest(self, src: _Compiled) -> bytes | None:
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
        self, src: _Compiled, labels: tuple[tuple[bytes, bytes], tuple[bytes, bytes]], missing: list[str]
    ) -> tuple[int | None, int | None]:
        if self.index is None:
            block_size, num_blocks, lacking = _cache_info(self._samples(src), src, labels)
        else:
            run = self.index.get(src.name)
            if run is None:
                missing.append(src.text)
                return None, None
            block_size, num_blocks, lacking = _cache_info_of_run(run, src, labels)
        missing.extend(lacking)
        return block_size, num_blocks


# What a pod's cache_config_info line and the labels of its newest LoRA series say change seldom
# (never, and when the set of adapters in use changes): their readings are remembered, keyed by
# the raw bytes. The numbers that change every scrape (queue, running, KV usage) are always read.
_REMEMBERED = 256


def _cache_info(
    samples: list[tuple[float, bytes]], src: _Compiled, labels: tuple[tuple[bytes, bytes], tuple[bytes, bytes]]
) -> tuple[int | None, int | None, tuple[str, ...]]:
    """Block size, number of blocks and what is missing, from the first matching series' labels."""
    if not samples:
        return None, None, (src.text,)
    block = samples[0][1]
    found = [_int(_label(block, name, key)) for name, key in labels]
    lacking = tuple(f"{src.text} label {name.decode()}" for (name, _), value in zip(labels, found) if value is None)
    return found[0], found[1], lacking


@functools.lru_cache(maxsize=_REMEMBERED)
def _cache_info_of_run(
    run: bytes, src: _Compiled, labels: tuple[tuple[bytes, bytes], tuple[bytes, bytes]]
) -> tuple[int | None, int | None, tuple[str, ...]]:
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
    # Without escapes every '"' is a delimiter: names (with their ',' and '=') and values alternate.
    parts = block.split(b'"')
    return dict(zip(map(_NAME_PART, parts[0::2]), parts[1::2]))


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


# --------------------------------------------------------------------------------------------- built-ins


def _sels(*texts: str) -> tuple[Selector, ...]:
    return tuple(parse_selector(t) for t in texts)


# Metric names: vLLM v1 (vllm/v1/metrics/loggers.py), SGLang (sglang/srt/metrics/collector.py),
# trtllm-serve's /prometheus/metrics, Triton's TensorRT-LLM backend; the selectors are upstream's
# built-in engineConfigs (llm-d-router extractor/metrics/factories.go), plus two fallbacks noted below.
_BUILTINS = (
    EngineMapping(
        "vllm",
        queued_requests=_sels("vllm:num_requests_waiting"),
        running_requests=_sels("vllm:num_requests_running"),
        # gpu_cache_usage_perc: the name before vLLM 0.10 (deprecated since, still served by some).
        kv_usage=_sels("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora=parse_selector("vllm:lora_requests_info"),
        cache_info=parse_selector("vllm:cache_config_info"),
    ),
    EngineMapping(
        "sglang",
        queued_requests=_sels("sglang:num_queue_reqs"),
        running_requests=_sels("sglang:num_running_reqs"),
        kv_usage=_sels("sglang:token_usage"),
        cache_info=parse_selector("sglang:cache_config_info"),
        cache_block_size_label="page_size",
        cache_num_blocks_label="num_pages",
        # SGLang 0.5.11 replaced the labels of cache_config_info with these two gauges.
        cache_block_size=_sels("sglang:page_size"),
        cache_num_blocks=_sels("sglang:num_pages"),
    ),
    EngineMapping(
        "trtllm-serve",
        queued_requests=_sels("trtllm_num_requests_waiting"),
        running_requests=_sels("trtllm_num_requests_running"),
        kv_usage=_sels("trtllm_kv_cache_utilization"),
        cache_block_size=_sels("trtllm_kv_cache_tokens_per_block"),
        cache_num_blocks=_sels("trtllm_kv_cache_max_blocks"),
    ),
    EngineMapping(
        "triton-tensorrt-llm",
        queued_requests=_sels('nv_trt_llm_request_metrics{request_type="waiting"}'),
        running_requests=_sels('nv_trt_llm_request_metrics{request_type="scheduled"}'),
        kv_usage=_sels('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'),
        cache_block_size=_sels('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}'),
        cache_num_blocks=_sels('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}'),
    ),
)
_BUILTIN_BY_NAME = {m.name: m for m in _BUILTINS}
_DEFAULT_ENGINE = "vllm"


def builtin_engines() -> dict[str, EngineMapping]:
    """The built-in mappings by engine name (the values of the engine-type pod label); a new dict each call."""
    return dict(_BUILTIN_BY_NAME)


def engine_for_label(
    value: str | None, engines: Mapping[str, EngineMapping] | None = None, *, default: str = _DEFAULT_ENGINE
) -> tuple[EngineMapping, bool]:
    """The mapping for a pod's engine-type label value, and whether that value was known.

    No label (``None`` or empty) gives the default engine and ``True``: unlabeled pods are the norm.
    An unknown value gives the default engine and ``False``, so the caller can warn once per pod.
    ``engines`` defaults to :func:`builtin_engines`; ``default`` must be one of its keys.
    """
    table = _BUILTIN_BY_NAME if engines is None else engines
    if not value:
        return table[default], True
    mapping = table.get(value)
    if mapping is None:
        return table[default], False
    return mapping, True


# Upstream's engineConfigs keys (core-metrics-extractor) -> EngineMapping fields.
_SELECTOR_KEYS = {
    "queuedRequestsSpec": "queued_requests",
    "runningRequestsSpec": "running_requests",
    "kvUsageSpec": "kv_usage",
    "loraSpec": "lora",
    "cacheInfoSpec": "cache_info",
    "cacheBlockSizeSpec": "cache_block_size",
    "cacheNumBlocksSpec": "cache_num_blocks",
}
_LABEL_KEYS = {
    "cacheBlockSizeLabelName": ("cache_block_size_label", "block_size"),
    "cacheNumBlocksLabelName": ("cache_num_blocks_label", "num_gpu_blocks"),
}
_SINGLE = frozenset({"lora", "cache_info"})


def engine_from_config(
    name: str, overrides: Mapping[str, str | None], base: EngineMapping | None = None
) -> EngineMapping:
    """Build a mapping from one upstream ``engineConfigs`` entry.

    Keys are upstream's: ``queuedRequestsSpec``, ``runningRequestsSpec``, ``kvUsageSpec``,
    ``loraSpec``, ``cacheInfoSpec``, ``cacheBlockSizeSpec``, ``cacheNumBlocksSpec`` (selectors; an
    empty string or ``None`` disables the field) and ``cacheBlockSizeLabelName``,
    ``cacheNumBlocksLabelName`` (label names read from ``cacheInfoSpec``; empty means the default).
    A ``name`` key, if present, must equal ``name``. A selector replaces the field's alternatives.

    ``base=None`` starts from nothing, so fields not given are disabled: upstream's semantics, where
    an entry named like a built-in replaces it entirely. Pass a base to change only some fields.
    Raises :class:`ValueError` naming the engine and the key for unknown keys and bad selectors.
    """
    if not name:
        raise ValueError("engine config name cannot be empty")
    changes: dict[str, object] = {}
    for key, value in overrides.items():
        if key == "name":
            if value != name:
                raise ValueError(f"engine {name!r}: 'name' is {value!r}, expected {name!r}")
            continue
        if key not in _SELECTOR_KEYS and key not in _LABEL_KEYS:
            valid = ", ".join(["name", *_SELECTOR_KEYS, *_LABEL_KEYS])
            raise ValueError(f"engine {name!r}: unknown key {key!r}; valid keys: {valid}")
        if value is not None and not isinstance(value, str):
            raise ValueError(f"engine {name!r}: {key} must be a string, got {type(value).__name__}")
        text = (value or "").strip()
        if key in _SELECTOR_KEYS:
            attr = _SELECTOR_KEYS[key]
            try:
                selector = parse_selector(text) if text else None
            except ValueError as exc:
                raise ValueError(f"engine {name!r}: {key}: {exc}") from None
            changes[attr] = selector if attr in _SINGLE else (() if selector is None else (selector,))
        else:
            attr, default_label = _LABEL_KEYS[key]
            if text and not _LABEL_NAME.match(text):
                raise ValueError(f"engine {name!r}: {key}: invalid label name {text!r}")
            changes[attr] = text or default_label
    return replace(base or EngineMapping(name), name=name, **changes)  # type: ignore[arg-type]
