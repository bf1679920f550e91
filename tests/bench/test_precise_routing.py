"""bench/precise_routing.py: the paired TTFT differences its targets print (no load is run here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load_bench():
    sys.path.insert(0, str(_BENCH))  # the bench imports routing_quality as a sibling module
    try:
        spec = importlib.util.spec_from_file_location("precise_routing", _BENCH / "precise_routing.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(_BENCH))


pr = _load_bench()


def _row(policy: str, round_: int, ttfts: dict[tuple[str, int], float], p90: float = 100.0):
    result = pr.rq.Result(
        workload="b", policy=policy, requests=len(ttfts), completed=len(ttfts), errors=0, unfinished=0,
        hit_rate=0.5, oracle_hit_rate=0.5, ttft_p50_ms=50.0, ttft_p90_ms=p90, req_per_s=1.0, tokens_per_s=1.0,
        round=round_,
    )  # fmt: skip
    return pr.Row(result, 1.0, ttfts=ttfts)


def _sessions(first: float, later: float) -> dict[tuple[str, int], float]:
    """Three sessions of three requests: each first request takes ``first`` ms, the others ``later``."""
    return {(f"session-{s}", i): (first if i == 0 else later) + s for s in range(3) for i in range(3)}


def test_the_paired_difference_is_taken_over_the_same_requests_and_split_by_place_in_the_session() -> None:
    peer = _row("sglang-router", 0, _sessions(90.0, 40.0))
    picker = _row("precise", 0, _sessions(97.0, 43.0))
    picker.ttfts[("session-9", 0)] = 1000.0  # a request the peer did not complete: left out of every median
    runs = [picker, peer]
    assert pr._paired(runs, "b", "precise", "sglang-router") == pytest.approx(3.0)
    assert pr._paired(runs, "b", "precise", "sglang-router", later=False) == pytest.approx(7.0)
    assert pr._paired(runs, "b", "precise", "sglang-router", later=True) == pytest.approx(3.0)
    assert pr._paired(runs, "b", "default", "sglang-router") is None  # no such run


def test_each_rounds_runs_are_paired_with_each_other_and_the_rounds_medians_taken() -> None:
    runs = [
        _row("precise", 0, _sessions(91.0, 41.0)), _row("sglang-router", 0, _sessions(90.0, 40.0)),
        _row("precise", 1, _sessions(95.0, 45.0)), _row("sglang-router", 1, _sessions(90.0, 40.0)),
        _row("precise", 2, _sessions(92.0, 42.0)), _row("sglang-router", 2, _sessions(90.0, 40.0)),
    ]  # fmt: skip
    assert pr._paired(runs, "b", "precise", "sglang-router") == pytest.approx(2.0)


def test_the_targets_print_the_split_for_families_and_not_for_requests_of_none() -> None:
    runs = [_row("precise", 0, _sessions(97.0, 43.0), p90=110.0), _row("sglang-router", 0, _sessions(90.0, 40.0))]
    (line,) = pr._targets(runs, runs=runs)
    assert "1.10x the best peer's (sglang-router, 100 ms)" in line
    assert "precise +3.0 ms" in line
    assert "a family's first request (a session's, a system prompt's) / its later ones: precise +7.0 / +3.0 ms" in line
    unrelated = {("", n): 50.0 + n for n in range(4)}  # requests of no family (workload c): nothing to split
    runs = [
        _row("precise", 0, unrelated, p90=110.0),
        _row("sglang-router", 0, {k: v - 1 for k, v in unrelated.items()}),
    ]
    (line,) = pr._targets(runs, runs=runs)
    assert "precise +1.0 ms" in line and "first request" not in line
