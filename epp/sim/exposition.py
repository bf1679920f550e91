"""The Prometheus text exposition format, written exactly as prometheus_client writes it.

Label sets are sorted by name and escaped, ``# HELP``/``# TYPE`` headers precede every family, integral
bucket bounds print as ``1.0`` and every counter and histogram has its ``_created`` gauge twin. A scraper
written for a real vLLM server (which uses prometheus_client) therefore reads the simulator's page unchanged.

:class:`Histogram` caches its text until the next observation, so a page of many histograms re-renders only
those that changed. :func:`restrict_page` answers ``?name[]=...`` queries the way prometheus_client does.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence

__all__ = ["CONTENT_TYPE", "Histogram", "header", "label_set", "restrict_page"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Content type of the Prometheus text exposition format."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def label_set(**labels: str) -> str:
    """``a="x",b="y"`` (without braces): names sorted and values escaped, as prometheus_client prints them."""
    return ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))


def header(name: str, doc: str, kind: str) -> str:
    """The ``# HELP`` and ``# TYPE`` lines of a family."""
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


class Histogram:
    """A Prometheus histogram of one label set, rendered as prometheus_client renders it.

    :meth:`render` gives a whole family; a family with several label sets is ``head`` + every series'
    :meth:`samples` + ``created_head`` + every series' ``created_line``.
    """

    __slots__ = ("_bounds", "_cache", "_cache_count", "_counts", "_prefixes", "_tail_count", "_tail_sum", "count",
                 "created_head", "created_line", "head", "sum")

    def __init__(self, name: str, doc: str, bounds: Sequence[float], labels: dict[str, str], created: float) -> None:
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last slot is +Inf
        les = [repr(b) for b in self._bounds] + ["+Inf"]  # integral bounds print as "1.0", like prometheus_client
        self._prefixes = [f"{name}_bucket{{{label_set(le=le, **labels)}}} " for le in les]
        base = f"{{{label_set(**labels)}}}" if labels else ""
        self._tail_count = f"{name}_count{base} "
        self._tail_sum = f"{name}_sum{base} "
        self._cache = ""
        self._cache_count = -1
        self.head = header(name, doc, "histogram")
        self.created_head = header(f"{name}_created", doc, "gauge")
        self.created_line = f"{name}_created{base} {created!r}\n"
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, n: int = 1) -> None:
        """Record ``n`` observations of ``value``."""
        self._counts[bisect_left(self._bounds, value)] += n
        self.sum += value * n
        self.count += n

    def bucket_counts(self) -> list[int]:
        """Cumulative counts per bucket, +Inf last (what the ``_bucket`` lines show)."""
        out, cum = [], 0
        for c in self._counts:
            cum += c
            out.append(cum)
        return out

    def samples(self) -> str:
        """The ``_bucket``, ``_count`` and ``_sum`` lines (cached until the next observation)."""
        if self._cache_count != self.count:
            parts = [f"{p}{c}.0\n" for p, c in zip(self._prefixes, self.bucket_counts(), strict=True)]
            parts.append(f"{self._tail_count}{self.count}.0\n{self._tail_sum}{float(self.sum)!r}\n")
            self._cache = "".join(parts)
            self._cache_count = self.count
        return self._cache

    def render(self) -> str:
        """The exposition text of this histogram as a family of its own."""
        return f"{self.head}{self.samples()}{self.created_head}{self.created_line}"


def restrict_page(page: bytes, names: Iterable[bytes]) -> bytes:
    """``page`` with only the families and samples named in ``names`` (their ``# HELP``/``# TYPE``
    lines kept), as prometheus_client's exposition answers ``/metrics?name[]=a&name[]=b``."""
    wanted = set(names)
    kept = []
    for line in page.split(b"\n"):
        if line.startswith((b"# HELP ", b"# TYPE ")):
            name = line.split(b" ", 3)[2]
        else:
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if line and name in wanted:
            kept.append(line)
    return b"\n".join(kept) + b"\n" if kept else b""
